"""What OpenTelemetry tracing (server/tracing.py) costs a worker: off (no endpoint, the default), on (spans
exported over OTLP/HTTP to a loopback receiver in this process), and the tree before tracing existed
(`--baseline-rev`, extracted with `git archive`) as the baseline of "off costs nothing".

Each measurement is a fresh child process (`--child`), so imports are cold for every one of them: it times
`import lmi_serve.server.app`, `create_app` (which builds the tracer when on), and then the request hooks of
`--requests` POSTs through Flask's test client to a model that is still loading (a 503 in Triton's dialect:
every hook runs, drain tracking, request id, access log, counts, and the span when on; no model work, so
the hooks are all that is timed). It also reports whether the OpenTelemetry SDK got imported. Rounds
rotate the order of the three children; the figures are medians over rounds, and ratios against `off`
(and `off` against the baseline).

    python -m benchmarks.bench_tracing [--rounds 5] [--requests 3000] [--baseline-rev ef1834c]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from benchmarks.benchmark.common import ROOT, cpu_summary

BASELINE_REV = "ef1834c"  # main before the tracing branch
MODES = ("baseline", "off", "on")


def child(mode: str, requests: int) -> dict:
    """One measurement, in this (fresh) process: import, app start, per-request hooks. Times are the
    process's CPU seconds (all its threads, the span exporter's included), which other work on a shared
    machine disturbs far less than wall time."""
    started = time.process_time()
    from lmi_serve.server.app import create_app
    imported = time.process_time()

    from lmi_serve.__main__ import DEFAULT_STORE
    from lmi_serve.config.sources import build_server_config
    from lmi_serve.serving.registry import ModelRegistry
    from lmi_serve.serving.service import ModelService

    env = {"HOME": "/tmp", **({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": os.environ["BENCH_OTLP_URL"]}
                              if mode == "on" else {})}
    config = build_server_config(env, default_store=DEFAULT_STORE)
    simple = next(model for model in config.models if model.name == "simple")
    config = config.model_copy(update={"models": (simple,)})
    before_app = time.process_time()
    app = create_app(config, ModelRegistry([ModelService(simple, config.cache_dir)]))
    created = time.process_time()
    client = app.test_client()
    for _ in range(200):  # warm: first-call costs out of the figure
        client.post("/v2/models/simple/generate", data=b"{}").close()
    begin, wall = time.process_time(), time.perf_counter()
    for i in range(requests):
        answer = client.post("/v2/models/simple/generate", data=b"{}",
                             headers={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"})
        answer.close()  # as gunicorn closes it: the access line is written, and the span made, then
    assert answer.status_code == 503, answer.status_code
    tracing = app.extensions.get("lmi_serve.server.tracing")
    if tracing is not None:
        tracing.shutdown()  # the export of what is still queued counts too
    per_request, wall = (time.process_time() - begin) / requests, (time.perf_counter() - wall) / requests
    return {"import_s": imported - started, "create_app_s": created - before_app, "request_us": per_request * 1e6,
            "request_wall_us": wall * 1e6,
            "sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
            "lmi_serve": str(Path(sys.modules["lmi_serve"].__file__).parents[1])}


def baseline_tree(rev: str, into: Path) -> Path:
    """`src/` of `rev`, extracted under `into`."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_child(mode: str, src: Path, requests: int, url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_MULTIPROC_DIR"))}
    env.update(PYTHONPATH=f"{src}{os.pathsep}{ROOT}", BENCH_OTLP_URL=url)
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_tracing", "--child", mode,
                           "--requests", str(requests)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["lmi_serve"]) == src, f"child {mode} imported lmi_serve from {result['lmi_serve']}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return 0

    from benchmarks.benchmark.suite import helper

    receiver = helper("otlp_receiver").OtlpReceiver()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as folder:
        trees = {"baseline": baseline_tree(args.baseline_rev, Path(folder)), "off": ROOT / "src", "on": ROOT / "src"}
        for round_ in range(args.rounds):
            order = MODES[round_ % 3:] + MODES[:round_ % 3]
            for mode in order:
                results[mode].append(run_child(mode, trees[mode], args.requests, receiver.url))
            print(f"round {round_ + 1}: " + ", ".join(f"{m} {results[m][-1]['request_us']:.1f} us" for m in order),
                  flush=True)
    exported = len(receiver.spans())
    receiver.stop()
    report(results, args, exported)
    return 0


def report(results: dict[str, list[dict]], args: argparse.Namespace, exported: int) -> None:
    print(f"\nCPU: {cpu_summary()}; {os.cpu_count()} CPUs visible; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.rounds} rounds x {args.requests} requests per child; baseline: {args.baseline_rev}; "
          f"spans the receiver got: {exported}")
    keys = ("import_s", "create_app_s", "request_us", "request_wall_us")
    medians = {mode: {key: statistics.median(r[key] for r in runs) for key in keys} for mode, runs in results.items()}
    print("CPU seconds of the child process (all threads); medians over rounds")
    print("| mode | import app (s) | create_app (s) | per request (us CPU) | per request (us wall) | SDK imported |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        m, sdk = medians[mode], {r["sdk_imported"] for r in results[mode]}
        print(f"| {mode} | {m['import_s']:.3f} | {m['create_app_s']:.4f} | {m['request_us']:.1f} | "
              f"{m['request_wall_us']:.1f} | {'/'.join(map(str, sorted(sdk)))} |")
    off, base, on = medians["off"], medians["baseline"], medians["on"]
    print(f"\noff / baseline: import {off['import_s'] / base['import_s']:.3f}, create_app "
          f"{off['create_app_s'] / base['create_app_s']:.3f}, per request {off['request_us'] / base['request_us']:.3f}")
    print(f"on / off: import {on['import_s'] / off['import_s']:.3f}, create_app "
          f"{on['create_app_s'] / off['create_app_s']:.3f}, per request {on['request_us'] / off['request_us']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
