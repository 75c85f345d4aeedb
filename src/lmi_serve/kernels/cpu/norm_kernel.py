"""RMSNorm of a few rows in one numba call, the bits of torch's `F.rms_norm` (kernels/layers/fused_norms.py).

On the CPU `F.rms_norm` is not one kernel: it runs pow, mean (a sum and a division), add, rsqrt and one or
two muls, ~7.5 µs for one 576-wide fp32 row; a bf16 layer's form (upcast, normalise, round, times the
weight) ~11 µs. A decode step has 61 of them. This kernel does a row in one pass over it (~2 µs, the
call included), with the same arithmetic in the same order, so the same bits:

- the sum of squares in the order of torch's CPU sum kernel (ATen's SumKernel.cpp): the row read as vectors
  of `lanes` floats into four vector accumulators taken in turn, in cascaded levels of 16 steps or more
  (each level's sum added into the next when it fills), the leftover vectors into the first accumulator,
  the four then added in order, and the leftover floats then each lane added, in order, to a scalar;
- the mean as that sum divided by the width, rsqrt as 1 / sqrt (both correctly rounded, as torch's);
- `direct` (fp32 in and out): (x * rsqrt) * weight; `upcast` (bf16): x widened to fp32, x * rsqrt rounded
  to bf16, times the weight rounded to bf16 (a product of two bf16 values is exact in fp32).

`lanes` is the vector width of torch's own reduction on this machine, found at compile time by comparing
sums with torch's (8 here, on an AVX-512 Zen 5: the reduction kernels run at AVX2 width); where neither 8
nor 16 gives torch's bits the kernel is unavailable. fused_norms.py still compares each layer's result with
the layer's own forward before it uses the kernel. Rows are independent: a row's bits do not depend on
the batch. Above MAX_ELEMENTS torch's kernels (two threads) are faster and are used instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmi_serve.kernels.cpu.numba_bits import NUMBA, CompiledOnce, helper
from lmi_serve.kernels.registry import max_elements

FORMS = {"direct": torch.float32, "upcast": torch.bfloat16}  # the forms it computes and their dtype
# One thread. 576-wide fp32 rows, µs a call (torch's F.rms_norm against this): 7.5 / 1.7 at 1 row, 10.4 / 6.1
# at 32, 18.3 / 20.5 at 132; bf16's form 10.9 / 1.9, 17.4 / 11.4, 33.6 / 42.7; 2048 wide at 32 rows level.
MAX_ELEMENTS = max_elements("norm")
_LEVELS = 4  # torch's cascade: four levels
_ACCUMULATORS = 4  # torch's row sum: four vector accumulators ("ilp")

if NUMBA:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import bf16, bf16_pointer, float32_pointer, widen


@helper
def _sum_of_squares(x, lanes):  # pragma: no cover - numba compiles it
    """sum(x * x) for the fp32 row x, in the order of torch's CPU sum kernel (module docstring)."""
    width = x.shape[0]
    vectors = width // lanes
    steps = vectors // _ACCUMULATORS  # one step: one vector into each accumulator
    ceil_log2 = 0
    while (1 << ceil_log2) < steps:
        ceil_log2 += 1
    level_power = max(4, ceil_log2 // _LEVELS)
    level_step = 1 << level_power
    acc = np.zeros((_LEVELS, _ACCUMULATORS, lanes), dtype=np.float32)
    i = 0
    while i + level_step <= steps:
        for _ in range(level_step):
            for k in range(_ACCUMULATORS):
                base = (i * _ACCUMULATORS + k) * lanes
                for lane in range(lanes):
                    acc[0, k, lane] += x[base + lane] * x[base + lane]
            i += 1
        for j in range(1, _LEVELS):
            for k in range(_ACCUMULATORS):
                for lane in range(lanes):
                    acc[j, k, lane] += acc[j - 1, k, lane]
                    acc[j - 1, k, lane] = 0.0
            if i & ((level_step - 1) << (j * level_power)):
                break
    while i < steps:
        for k in range(_ACCUMULATORS):
            base = (i * _ACCUMULATORS + k) * lanes
            for lane in range(lanes):
                acc[0, k, lane] += x[base + lane] * x[base + lane]
        i += 1
    for j in range(1, _LEVELS):
        for k in range(_ACCUMULATORS):
            for lane in range(lanes):
                acc[0, k, lane] += acc[j, k, lane]
    for v in range(steps * _ACCUMULATORS, vectors):  # vectors left over: into the first accumulator
        for lane in range(lanes):
            acc[0, 0, lane] += x[v * lanes + lane] * x[v * lanes + lane]
    for k in range(1, _ACCUMULATORS):
        for lane in range(lanes):
            acc[0, 0, lane] += acc[0, k, lane]
    total = np.float32(0.0)
    for d in range(vectors * lanes, width):  # floats left over, then the lanes
        total += x[d] * x[d]
    for lane in range(lanes):
        total += acc[0, 0, lane]
    return total


@helper
def inverse_rms(x, eps, lanes):  # pragma: no cover - numba compiles it
    return np.float32(1.0) / np.sqrt(_sum_of_squares(x, lanes) / np.float32(x.shape[0]) + eps)


def _direct(x_address, rows, width, weight_address, eps, out_address, lanes):  # pragma: no cover - numba
    x = numba.carray(float32_pointer(x_address), (rows, width))
    weight = numba.carray(float32_pointer(weight_address), (width,))
    out = numba.carray(float32_pointer(out_address), (rows, width))
    for r in range(rows):
        inverse = inverse_rms(x[r], eps, lanes)
        for d in range(width):
            out[r, d] = (x[r, d] * inverse) * weight[d]


@helper
def upcast_rows(x, rows, width, weight, eps, lanes, out):  # pragma: no cover - numba compiles it
    """out = the bf16 form's RMSNorm of rows x (bf16 bits, pointers or 1-D arrays; kernels/cpu/layer_chain.py's too)."""
    row = np.empty(width, dtype=np.float32)
    for r in range(rows):
        for d in range(width):
            row[d] = widen(x[r * width + d])
        inverse = inverse_rms(row, eps, lanes)
        for d in range(width):
            out[r * width + d] = bf16(widen(bf16(row[d] * inverse)) * widen(weight[d]))


def _upcast(x_address, rows, width, weight_address, eps, out_address, lanes):  # pragma: no cover - numba
    upcast_rows(bf16_pointer(x_address), rows, width, bf16_pointer(weight_address), eps, lanes,
                bf16_pointer(out_address))


def _torch_lanes(compiled: Any) -> int | None:
    """The vector width at which this kernel answers `F.rms_norm`'s bits (rows of several widths, with and
    without a cascade), or None."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, width, generator=generator).mul(3) for width in (17, 100, 576, 2048, 5000)]
    for lanes in (8, 16):
        agree = True
        for x in rows:
            weight, out = torch.ones(x.shape[1]), torch.empty_like(x)
            compiled["direct"](x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), np.float32(1e-6),
                               out.data_ptr(), lanes)
            agree = agree and torch.equal(out, torch.nn.functional.rms_norm(x, (x.shape[1],), weight, 1e-6))
        if agree:
            return lanes
    return None


def _compile() -> dict[str, Any]:
    compiled = {form: numba.njit(cache=True, nogil=True)(function)
                for form, function in (("direct", _direct), ("upcast", _upcast))}
    lanes = _torch_lanes(compiled)
    if lanes is None:
        raise RuntimeError("its sums are not torch's at 8 or 16 lanes")
    compiled["lanes"] = lanes
    return compiled


_compiled = CompiledOnce(_compile, "RMSNorm kernel unavailable, F.rms_norm normalises")


def kernel() -> dict[str, Any] | None:
    """The compiled kernels by form and torch's lane count, or None where numba is missing or its sums
    are not torch's (logged once)."""
    return _compiled.get()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """The RMSNorm of `x` [..., width] (contiguous, on the CPU, of `form`'s dtype as `weight` is) over its last
    dimension, `form`'s arithmetic; only once `kernel()` is not None."""
    compiled = _compiled.value
    out = torch.empty_like(x)
    width = x.shape[-1]
    compiled[form](x.data_ptr(), x.numel() // width, width, weight.data_ptr(), np.float32(eps), out.data_ptr(),
                   compiled["lanes"])
    return out
