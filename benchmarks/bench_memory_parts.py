"""A fresh worker's resident memory by part, for the default store, with the kernels' memory on and off.

For each layout (the default; `option.row_kernel=off`; torch's Linear and SDPA: no packed weights, no copies,
no numba kernels compiled), starts the default server, sends a few short requests, waits until idle, and prints
the worker's RSS (anonymous and file-backed) beside the parts GET /models/<m> reports (serving/memory_report.py):
every model's weights in the forms its kernels read, the row kernel's copies, K/V and prefix cache held now.
`other` is RSS minus those parts: torch, numba's compiled kernels, tokenizers, Python, the allocator's free pages.
The baseline is the first layout's RSS, in the same run.

Run: .venv/bin/python -m benchmarks.bench_memory_parts [--layouts default,row-off,torch]
"""

from __future__ import annotations

import argparse
import time

import requests

from benchmarks.bench_memory import memory, settle
from benchmarks.benchmark.common import cpu_summary
from benchmarks.benchmark.suite import helper
from benchmarks.soak import worker_pid

ServerProcess = helper("server_process").ServerProcess

LAYOUTS = {
    "default": {},
    "row-off": {"OPTION_ROW_KERNEL": "off"},
    "torch": {"OPTION_LINEAR_KERNEL": "torch", "OPTION_DECODE_ATTENTION": "sdpa"},
}
PARTS = ("weightsBytes", "rowKernelCopiesBytes", "kvCacheBytes", "prefixCacheBytes")
MIB = 2**20


def measure(env: dict[str, str]) -> dict:
    server = ServerProcess(env=env)
    try:
        server.wait_for_ping()
        for words in ("The capital of France is", "Write a haiku about the sea."):
            requests.post(server.url("/invocations"), json={"inputs": words, "parameters": {"max_new_tokens": 16}},
                          timeout=300).raise_for_status()
        requests.post(server.url("/invocations"), params={"model_name": "all-minilm-l6-v2"},
                      json={"inputs": ["a sentence"]}, timeout=300).raise_for_status()
        pid = worker_pid(server.proc.pid)
        settle(pid, 20)
        models = [m["modelName"] for m in requests.get(server.url("/models"), timeout=30).json()["models"]]
        parts = {}
        for name in models:
            entry = requests.get(server.url(f"/models/{name}"), timeout=30).json()[0]["models"][0]
            parts[name] = {k: entry["memory"].get(k, 0) for k in PARTS}
        return {"status": memory(pid), "parts": parts}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    print(cpu_summary())
    baseline = None
    for layout in args.layouts.split(","):
        started = time.monotonic()
        result = measure(LAYOUTS[layout])
        status, parts = result["status"], result["parts"]
        counted = sum(sum(p.values()) for p in parts.values()) / MIB
        baseline = baseline or status["VmRSS"]
        print(f"\n{layout}: RSS {status['VmRSS']:.0f} MiB (x{status['VmRSS'] / baseline:.2f} of the first layout; "
              f"anon {status['RssAnon']:.0f}, file {status['RssFile']:.0f}); parts counted {counted:.0f} MiB, "
              f"other {status['VmRSS'] - counted:.0f} MiB ({time.monotonic() - started:.0f} s)")
        for name, p in parts.items():
            print(f"  {name:<24} " + "  ".join(f"{k.removesuffix('Bytes')} {v / MIB:6.1f}" for k, v in p.items()))


if __name__ == "__main__":
    main()
