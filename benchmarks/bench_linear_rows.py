"""Which Linear kernel at which row count, per layer shape, and which of them is batch-invariant.

For SmolLM2-135M's Linear shapes (q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576, lm_head
576x49152), fp32, torch's threads = the cores: the time of one call at 1, 4 and 32 rows for MKL's sgemm
(`nn.Linear`) and oneDNN's matmul on weights packed for 1 and for 32 rows (kernels/layers/linear_kernels.py packs
for 32); then, per kernel, whether row 0 of a B-row call equals the 1-row call bit for bit for B in 2..33
(batch invariance: the rolling engine's greedy output must not depend on the batch).

Run: .venv/bin/python -m benchmarks.bench_linear_rows
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.benchmark.common import cpu_summary  # noqa: E402

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
ROWS = (1, 4, 32)


def timed(fn, x, reps: int = 50) -> float:
    for _ in range(5):
        fn(x)
    started = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - started) / reps * 1e3


def kernels(weight: torch.Tensor) -> dict:
    packed = {rows: torch.ops.mkldnn._reorder_linear_weight(weight, rows) for rows in (1, 32)}
    out = {"mkl": lambda x: torch.nn.functional.linear(x, weight)}
    for rows, pack in packed.items():
        out[f"onednn/{rows}"] = lambda x, pack=pack: torch.ops.mkldnn._linear_pointwise(x, pack, None, "none", [], "")
    return out


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"# {cpu_summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape (in x out) | rows | " + " | ".join(["mkl ms", "onednn/1 ms", "onednn/32 ms"]) + " |")
    print("|---|---|---|---|---|")
    invariance = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for fan_in, fan_out in SHAPES:
            weight = torch.randn(fan_out, fan_in)
            ks = kernels(weight)
            for rows in ROWS:
                x = torch.randn(rows, fan_in)
                print(f"| {fan_in}x{fan_out} | {rows} | " + " | ".join(f"{timed(k, x):.3f}" for k in ks.values()) + " |")
            x = torch.randn(33, fan_in)
            for name, k in ks.items():
                one = k(x[:1])
                invariance.setdefault(name, []).append(all(torch.equal(k(x[:b])[:1], one) for b in range(2, 34)))
    print("\nbatch-invariant (row 0 of every B in 2..33 equals the 1-row call), per shape above:")
    for name, flags in invariance.items():
        print(f"  {name:10} {' '.join('yes' if f else 'NO' for f in flags)}")


if __name__ == "__main__":
    main()
