"""Start-up figures for the default models: cold (GGUF converted into an empty cache) and warm
(safetensors cache reused), each as seconds to a healthy /ping and the server's RSS.

Run: .venv/bin/python -m benchmarks.bench_startup [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import psutil
import requests

from benchmarks.benchmark.suite import helper
ServerProcess = helper("server_process").ServerProcess


def measure(cache_dir: str) -> tuple[float, float, float]:
    started = time.monotonic()
    server = ServerProcess(env={"LMI_SERVE_CACHE_DIR": cache_dir})
    try:
        server.wait_for_ping(timeout=600)
        healthy = time.monotonic() - started
        requests.post(server.url("/invocations"), json={"inputs": "The capital of France is"}, timeout=60)
        processes = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        rss = {p.pid: p.memory_info().rss / 2**20 for p in processes}
        worker = max(rss.values())
        return healthy, worker, sum(rss.values())
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            cold = measure(cache)
            warm = measure(cache)
        rows.append((cold, warm))
        print(f"run {run + 1}: cold {cold[0]:.1f} s, warm {warm[0]:.1f} s", flush=True)
    print("\n| start | seconds to healthy (median) | worker RSS MiB | all processes RSS MiB |")
    print("|---|---|---|---|")
    for label, index in (("cold (GGUF -> safetensors)", 0), ("warm (cached safetensors)", 1)):
        pick = [row[index] for row in rows]
        print(f"| {label} | {statistics.median(p[0] for p in pick):.1f} | "
              f"{statistics.median(p[1] for p in pick):.0f} | {statistics.median(p[2] for p in pick):.0f} |")
    cold_s = statistics.median(r[0][0] for r in rows)
    warm_s = statistics.median(r[1][0] for r in rows)
    print(f"\nwarm start is {cold_s / warm_s:.1f}x faster than cold")


if __name__ == "__main__":
    main()
