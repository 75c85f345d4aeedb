"""Multi-model endpoint load and unload: `--cycles` times POST /models then DELETE /models/<m> of the
same model through the HTTP API of a real server in multi-model mode (SAGEMAKER_MULTI_MODEL=true), one
generation between them. Prints each cycle's load and unload seconds and the worker's RSS after the
unload, then the p50 times and the RSS growth from the first cycle to the last.

The model: the embedded SmolLM2-135M-Instruct (its GGUF from the PyPI package, converted once into
lmi-serve's cache), as a folder under a temporary models root holding only its serving.properties.

    .venv/bin/python -m benchmarks.bench_mme [--cycles 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.bench_openai import start_server  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402
from benchmarks.soak import proc_status, worker_pid  # noqa: E402

PROPERTIES = Path(__file__).resolve().parents[1] / "src/lmi_serve/serving/defaults/smollm2-135m-instruct/serving.properties"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--port", type=int, default=8394)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lmi-bench-mme-"))
    (root / "smollm2").mkdir()
    (root / "smollm2" / "serving.properties").write_text(PROPERTIES.read_text())
    print(f"CPU: {cpu_summary()}")
    proc = start_server(args.port, env={"SAGEMAKER_MULTI_MODEL": "true", "OPTION_MODEL_URL_ROOT": str(root)},
                        log_prefix="lmi-bench-mme-")
    base = f"http://127.0.0.1:{args.port}"
    pid = worker_pid(proc.pid)
    rows = []
    try:
        idle = proc_status(pid)[0]
        print(f"worker RSS with no model: {idle:.0f} MiB")
        print("| cycle | load s | unload s | RSS after unload MiB |")
        print("|---|---|---|---|")
        for cycle in range(1, args.cycles + 1):
            started = time.perf_counter()
            loaded = requests.post(f"{base}/models", json={"model_name": "smollm2", "url": str(root / "smollm2")},
                                   timeout=600)
            load_s = time.perf_counter() - started
            if loaded.status_code != 200:
                raise RuntimeError(f"load {cycle}: {loaded.status_code} {loaded.text}")
            answer = requests.post(f"{base}/models/smollm2/invoke", timeout=120,
                                   json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}})
            answer.raise_for_status()
            started = time.perf_counter()
            requests.delete(f"{base}/models/smollm2", timeout=600).raise_for_status()
            unload_s = time.perf_counter() - started
            time.sleep(1)  # the idle trim and the collector have run
            rss = proc_status(pid)[0]
            rows.append((load_s, unload_s, rss))
            print(f"| {cycle} | {load_s:.2f} | {unload_s:.2f} | {rss:.0f} |", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    loads, unloads, rss = zip(*rows)
    print(f"load p50 {statistics.median(loads):.2f} s, unload p50 {statistics.median(unloads):.2f} s; "
          f"RSS after unload: first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB ({rss[-1] - rss[0]:+.0f} MiB over "
          f"{len(rows) - 1} more cycles), max {max(rss):.0f} MiB; with no model {idle:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
