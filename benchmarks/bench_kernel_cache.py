"""What the size of oneDNN's kernel caches costs and holds: speed and the worker's RSS, side by side.

fp32 Linear layers run on oneDNN (kernels/layers/linear_kernels.py), and two caches keep a compiled kernel per
(layer shape, input rows): ideep's (`LRU_CACHE_CAPACITY`, 1,024 entries unless set) and oneDNN's own
primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1,024 unless set). Under prompts of many lengths
every prefill is a new row count, so both fill up and the worker's RSS climbs for as long as new
lengths arrive (scripts/soak). Each configuration here gets its own server, started twice in
alternation (ABCABC) so a noisy machine spreads over all of them, and the same closed-loop workload:
streamed LMI requests whose prompts span 10 to 1,200 tokens. Prints tok/s, TTFT and TPOT p50 as
ratios to the first configuration (torch's defaults), and the worker's RSS once idle after the load.

    .venv/bin/python -m benchmarks.bench_kernel_cache [--requests 48] [--concurrency 1,16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import requests

from benchmarks.bench_openai import start_server  # noqa: E402
from benchmarks.benchmark.clients import closed_loop, stream_one  # noqa: E402
from benchmarks.benchmark.common import DEFAULT_MODEL, cpu_summary  # noqa: E402
from benchmarks.benchmark.stats import summarize  # noqa: E402
from benchmarks.benchmark.workload import build_workload, model_folder  # noqa: E402
from benchmarks.soak import proc_status, worker_pid  # noqa: E402

CONFIGS = {  # name -> (LRU_CACHE_CAPACITY, ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    "torch defaults (1024 / 1024)": ("1024", "1024"),
    "oneDNN 64 only (1024 / 64)": ("1024", "64"),
    "both 64 (64 / 64)": ("64", "64"),
}


def idle_rss(base: str, master: int) -> float | None:
    """The worker's RSS (MiB) once the engine has had time to go idle and trim its heap (memory.py)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = requests.get(base + "/metrics", timeout=10).text
        running = [line for line in text.splitlines() if line.startswith("lmi_serve:num_requests_running")]
        if all(float(line.rsplit(" ", 1)[1]) == 0 for line in running):
            break
        time.sleep(0.5)
    time.sleep(3)  # past memory.IDLE_SECONDS
    pid = worker_pid(master)
    status = proc_status(pid) if pid else None
    return status[0] if status else None


def run_config(name: str, env: tuple[str, str], args, workload, port: int) -> dict:
    os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env
    proc = start_server(port, log_prefix="lmi-bench-kernel-cache-")
    base = f"http://127.0.0.1:{port}"
    try:
        closed_loop(stream_one, base + "/invocations", workload, 2, 4)  # warm-up
        warm = idle_rss(base, proc.pid)
        points = {}
        for c in args.concurrency:
            records, wall = closed_loop(stream_one, base + "/invocations", workload, c, args.requests)
            points[c] = summarize(name, c, records, wall)
        return {"points": points, "rss_warm": warm, "rss_after": idle_rss(base, proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48, help="requests per point (default 48)")
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=2, help="times each configuration is started (default 2)")
    p.add_argument("--port", type=int, default=8393)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(DEFAULT_MODEL))
    workload = build_workload(tokenizer, args.requests, (10, 1200), (16, 32))
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_no in range(args.rounds):
        for name, env in CONFIGS.items():
            runs[name].append(run_config(name, env, args, workload, args.port))
            print(f"[bench] round {round_no + 1} {name}: done", file=sys.stderr, flush=True)

    def median(name, c, key):
        values = [run["points"][c][key] for run in runs[name] if run["points"][c][key] is not None]
        return statistics.median(values) if values else None

    base_name = next(iter(CONFIGS))
    print(f"\n## oneDNN kernel caches ({time.strftime('%Y-%m-%d %H:%M')}, {cpu_summary()}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}; {args.requests} streamed requests per point, prompts 10-1,200 tokens, "
          f"median of {args.rounds} starts)\n")
    print("| LRU / oneDNN capacity | c | tok/s | x base | TTFT p50 ms | x base | TPOT p50 ms | x base | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        for c in args.concurrency:
            row = {key: median(name, c, key) for key in ("tok_s", "ttft_p50", "tpot_p50")}
            ref = {key: median(base_name, c, key) for key in row}
            ratio = {key: (row[key] / ref[key] if row[key] and ref[key] else None) for key in row}
            errors = sum(run["points"][c]["errors"] for run in runs[name])
            print(f"| {name} | {c} | {row['tok_s']:.1f} | {ratio['tok_s']:.2f} | {1e3 * row['ttft_p50']:.0f} | "
                  f"{ratio['ttft_p50']:.2f} | {1e3 * row['tpot_p50']:.1f} | {ratio['tpot_p50']:.2f} | {errors} |")
    print("\n| LRU / oneDNN capacity | worker RSS warm -> after the load, MiB (each start) |")
    print("|---|---|")
    for name in CONFIGS:
        cells = ", ".join(f"{run['rss_warm']:.0f} -> {run['rss_after']:.0f} (+{run['rss_after'] - run['rss_warm']:.0f})"
                          for run in runs[name] if run["rss_warm"] and run["rss_after"])
        print(f"| {name} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
