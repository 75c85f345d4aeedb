#!/usr/bin/env python3
"""One stream against the weights' bandwidth: how far a batch-1 decode step is from its memory floor.

A decode step at one row reads every Linear weight once (the matrix-vector products) and little else, so
its floor on a CPU is the weights' bytes / the box's read bandwidth. This script measures both on this
box and the engine's batch-1 step (`Batch.decode` on the slots cache, the scheduler's decode phase) for:

- `fp32`: the default, exact path (fp32 weights on oneDNN's packed matmul, option.linear_kernel=auto);
- `bf16`: option.dtype=bf16 (bf16 weights on oneDNN's bf16 matmul where the CPU computes bf16);
- `fp16`: option.quantize=fp16 (fp16 weights, fp32 arithmetic, fbgemm).

Read bandwidth: a sum over a buffer far larger than the last-level cache (default 1 GiB), with torch's
threads (the server's count: the cores), the best of one sum before each round of steps (the box's bandwidth
drifts: measured beside the steps, not once before them). The floor of a variant is the bytes its Linear
layers hold (each read once per token; a tied lm_head counts once, as its own packed copy) / that
bandwidth. The step's time / the floor is the figure issue 33 sets at 1.3x for the default path.

    .venv/bin/python -m benchmarks.bench_bandwidth [--variants fp32,bf16,fp16] [--context 200]
                                                   [--repeats 15] [--steps 4] [--buffer-mib 1024] [--threads N]

Printed with the CPU model and its SIMD flags and the load average before and after: a shared box's
figures move by tens of percent, the ratios within one run much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from benchmarks.bench_step import GGUF_FILE, MODEL_ID, context_tokens, prefill_one, time_decode  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402
from benchmarks.benchmark.step_quality import PERPLEXITY_TEXT  # noqa: E402

from lmi_serve.engine.kv.select import KV_LAYOUTS  # noqa: E402
from lmi_serve.kernels.attention import use_decode_kernel  # noqa: E402
from lmi_serve.kernels.layers.shared_input import SharedInputSlice  # noqa: E402

VARIANTS = ("fp32", "bf16", "fp16")


def read_seconds(buffer: torch.Tensor) -> float:
    """Seconds of one sum over `buffer`: a read of all its bytes."""
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def timed_rounds(buffer: torch.Tensor, batches: dict, rounds: int, warmup: int, steps: int
                 ) -> tuple[float, dict[str, list[float]], dict[str, list[float]]]:
    """The best read bandwidth (bytes/s) and each variant's decode step times, measured in turns (one sum, then
    `steps` consecutive steps of each variant, per round): this box's bandwidth moves by tens of percent from
    minute to minute (47 to 77 GB/s in three runs a minute apart), so the floor is read while the steps run,
    not before. Returns the bandwidth, the first step of each variant's turn (after the sum or the other
    variant's steps: caches and threads cold) and the steps after it (a stream's steady state, as served)."""
    read_seconds(buffer)  # the first pass faults the pages in
    best = float("inf")
    first: dict[str, list[float]] = {name: [] for name in batches}
    after: dict[str, list[float]] = {name: [] for name in batches}
    for round_ in range(warmup + rounds):
        best = min(best, read_seconds(buffer))
        for name, batch in batches.items():
            seconds = time_decode({name: batch}, steps, warmup=0)[name]
            if round_ >= warmup:
                first[name].append(seconds[0])
                after[name].extend(seconds[1:])
    return buffer.numel() * buffer.element_size() / best, first, after


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's Linear layers read per token: parameters of every module that is a linear
    layer (nn.Linear, or our swapped kinds, whose packed weights are opaque: counted from their shapes).
    A stacked layer (kernels/layers/shared_input.py) counts once; its slices, which read its output, not weights,
    count nothing."""
    total = 0
    for module in model.modules():
        in_f, out_f = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if in_f is None or out_f is None or any(True for _ in module.children()):
            continue
        if isinstance(module, SharedInputSlice):  # columns of a stacked layer, which is counted whole
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            total += weight.numel() * weight.element_size()
        else:
            dtype = getattr(module, "dtype", torch.float32)
            size = 2 if dtype in (torch.bfloat16, torch.float16) or "Fp16" in type(module).__name__ else 4
            total += in_f * out_f * size
    return total


def load(variant: str):
    from lmi_serve.kernels.layers.linear_kernels import use_linear_kernel
    from lmi_serve.model.loader import load_generation_model
    from lmi_serve.kernels.layers.quantize import quantize_model

    lm = load_generation_model(MODEL_ID, gguf_file=GGUF_FILE, dtype="bf16" if variant == "bf16" else "auto")
    if variant == "fp16":
        quantize_model(lm.model, "fp16", lm.device)
    use_linear_kernel(lm.model, "auto", lm.device)
    KV_LAYOUTS["slots"].prepare(lm.model)  # as engine/build.py does: the slots cache's attention, and the
    use_decode_kernel(lm.model, True)      # decode kernel where it applies (fp32 on the CPU)
    return lm


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--context", type=int, default=200, help="tokens already in the row's KV cache (default 200)")
    p.add_argument("--repeats", type=int, default=15, help="rounds: a bandwidth probe, then each variant's steps "
                                                           "(default 15)")
    p.add_argument("--steps", type=int, default=4, help="consecutive steps of a variant per round (default 4)")
    p.add_argument("--buffer-mib", type=int, default=1024, help="the bandwidth probe's buffer (default 1024)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, the server's)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown --variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_summary()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}")
    models = {v: load(v) for v in variants}
    tokenizer = next(iter(models.values())).tokenizer
    text_ids = tokenizer(PERPLEXITY_TEXT.read_text()).input_ids
    prompt = context_tokens(text_ids, args.context)
    slots = KV_LAYOUTS["slots"]
    batches = {v: prefill_one(lm.model, tokenizer, lm.device, slots, prompt) for v, lm in models.items()}
    buffer = torch.ones(args.buffer_mib * 2**20 // 4, dtype=torch.float32)
    bandwidth, first, after = timed_rounds(buffer, batches, args.repeats, warmup=3, steps=max(2, args.steps))
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum over {args.buffer_mib} MiB, best of {args.repeats + 3}, "
          "each before a round of steps)")
    print(f"\nbatch-1 decode step (Batch.decode, slots cache, KV {args.context}), ms; floor = Linear weight bytes / "
          "read bandwidth")
    print(f"{'variant':<8}{'steps':>7}{'weights MB':>12}{'floor ms':>10}{'min ms':>9}{'median ms':>11}"
          f"{'x floor (min)':>15}{'x floor (median)':>18}")
    for variant, lm in models.items():
        weights = linear_bytes(lm.model)
        floor = weights / bandwidth
        for label, times in (("first", first[variant]), ("after", after[variant])):
            best, median = min(times), statistics.median(times)
            print(f"{variant:<8}{label:>7}{weights / 1e6:>12.0f}{floor * 1e3:>10.2f}{best * 1e3:>9.2f}"
                  f"{median * 1e3:>11.2f}{best / floor:>15.2f}{median / floor:>18.2f}")
    print("(first: a variant's first step of a round, after the probe or another variant's steps; after: the "
          "steps that follow it, a stream's steady state)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
