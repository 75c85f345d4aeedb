#!/usr/bin/env python3
"""Tokens per second at 1 and at 2 tensor-parallel ranks, side by side (model/tp.py, engine/kv/replicate.py).

The model is SmolLM2-135M widened with zero heads so 2 ranks can split it (tests/tp_model.py: the same
logits). For each degree a server starts with option.tensor_parallel_degree=1 or 2 (both with
option.linear_kernel=torch, the kernel sharded layers keep, so only the ranks differ), plus one rank
pinned to one core (taskset) for reference, then:
- single: one greedy stream of --tokens tokens (decode speed of one row);
- batch: --concurrency such requests at once (the rolling batch's throughput).
Rounds alternate the setups; the table gives the best round of each and the 2-rank/1-rank ratio.

    .venv/bin/python -m benchmarks.bench_tp [--rounds 2] [--tokens 64] [--concurrency 8]

On a CPU, 2 ranks split the same cores (each gets cores // 2 threads) and add two all-reduces per
layer over gloo: expect no speed-up on a small machine; tensor parallelism is for a model that does
not fit one device. The machine may be shared and noisy: read the ratio within one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.bench_openai import start_server  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402
from benchmarks.benchmark.suite import helper

free_port = helper("server_process").free_port
smollm2_folder = helper("tp_model").smollm2_folder
widen_heads = helper("tp_model").widen_heads

PROMPTS = ["Tell me a story about a dragon.", "Explain how rain forms.", "List some fruits:",
           "Write a poem about the sea.", "What is the capital of France?", "Once upon a time",
           "The best way to learn Python is", "Describe a sunset."]


def generate(port: int, prompt: str, tokens: int) -> int:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True}}
    response = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["details"]["generated_tokens"]


# (label, ranks, cores the server may use: None for all of them)
SETUPS = (("1 rank", 1, None), ("2 ranks", 2, None), ("1 rank, 1 core", 1, 1))


def start(port: int, ranks: int, cores: int | None, model: Path) -> subprocess.Popen:
    """A server of `ranks` ranks, on its first `cores` cores (taskset; the worker's torch threads
    follow its affinity) or on all; returned once /ping answers 200."""
    env = {"OPTION_MODEL_ID": str(model), "OPTION_TASK": "text-generation", "OPTION_LINEAR_KERNEL": "torch",
           "OPTION_TENSOR_PARALLEL_DEGREE": str(ranks)}
    return start_server(port, log_prefix=f"lmi-bench-tp{ranks}-", env=env,
                        wrapper=["taskset", "-c", f"0-{cores - 1}"] if cores else ())


def one_round(model: Path, ranks: int, cores: int | None, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    proc = start(port, ranks, cores, model)
    try:
        generate(port, PROMPTS[0], 4)  # first-request setup out of the figures
        started = time.perf_counter()
        single = generate(port, PROMPTS[0], args.tokens) / (time.perf_counter() - started)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            total = sum(pool.map(lambda i: generate(port, PROMPTS[i % len(PROMPTS)], args.tokens),
                                 range(args.concurrency)))
        batch = total / (time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.wait(60)
    return {"single": single, "batch": batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmi-bench-tp-") as folder:
        model = widen_heads(smollm2_folder(), Path(folder) / "smollm2-wide")
        best: dict[str, dict[str, float]] = {label: {} for label, _, _ in SETUPS}
        for round_ in range(args.rounds):
            for label, ranks, cores in SETUPS:
                figures = one_round(model, ranks, cores, args)
                print(f"round {round_ + 1}, {label}: single {figures['single']:.1f} tok/s, "
                      f"{args.concurrency} streams {figures['batch']:.1f} tok/s", flush=True)
                for key, value in figures.items():
                    best[label][key] = max(best[label].get(key, 0.0), value)
    print(f"\nCPU: {cpu_summary()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<24}" + "".join(f"{label:>16}" for label, _, _ in SETUPS) + f"{'2 / 1 rank':>12}{'2 / 1 core':>12}")
    for key, label in (("single", "single stream tok/s"), ("batch", f"{args.concurrency} streams tok/s")):
        values = [best[name][key] for name, _, _ in SETUPS]
        print(f"{label:<24}" + "".join(f"{v:>16.1f}" for v in values)
              + f"{values[1] / values[0]:>12.2f}{values[1] / values[2]:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
