"""Rotary embedding of q and k together in one numba call, torch's bits (kernels/layers/lean_layers.py).

A lean layer rotates q and k (adjacent columns of one stacked output) as `x * cos + roll(x, half) * sin'`: a
view, a transpose, a roll (a narrow and a cat) and three arithmetic ops, ~10 torch calls a layer, 300 a SmolLM2
step whatever the batch. This kernel reads the stacked output's q and k columns where they are and writes the
rotated heads as one contiguous [batch, heads, tokens, head_dim] tensor, with the same arithmetic: in fp32 the
two products and their sum each rounded once (no fused multiply-add: numba compiles without `contract` here),
in bf16 each of the three rounded to bf16 as torch's bf16 ops do. tests/unit/model/test_lean_layers.py holds a
model's logits to transformers' bits with it; above MAX_ELEMENTS (a long prompt) torch's ops run instead.
"""

from __future__ import annotations

from typing import Any

import torch

from lmi_serve.kernels.cpu.numba_bits import NUMBA, CompiledOnce
from lmi_serve.kernels.registry import max_elements

MAX_ELEMENTS = max_elements("rotary")  # one thread; a 2,000-token prompt's 1.5 M elements go to torch's two threads

if NUMBA:
    import numba
    from numba.core import types
    from numba.extending import overload

    from lmi_serve.kernels.cpu.numba_bits import bf16, bf16_pointer, float32_pointer, widen


def rotated(x, cos, rolled, sin):  # pragma: no cover - numba compiles its overload below
    """x * cos + rolled * sin with torch's roundings for the elements' dtype."""
    raise NotImplementedError


if NUMBA:
    @overload(rotated, inline="always")
    def _rotated(x, cos, rolled, sin):
        if x == types.uint16:  # bf16 bits: each product, then the sum, rounded to bf16 as torch's bf16 ops do
            return lambda x, cos, rolled, sin: bf16(widen(bf16(widen(x) * widen(cos)))
                                                    + widen(bf16(widen(rolled) * widen(sin))))
        return lambda x, cos, rolled, sin: x * cos + rolled * sin  # fp32: each rounded once, no fused multiply-add


def _rotate(x, cos, sin, out, batch_stride, token_stride):  # pragma: no cover - numba compiles it
    """out [batch, heads, tokens, dim] from x's first heads (row b, token t at b * batch_stride + t *
    token_stride), cos and sin [batch or 1, tokens, dim]."""
    batch, heads, tokens, dim = out.shape
    half = dim // 2
    for b in range(batch):
        c = b if cos.shape[0] > 1 else 0
        for t in range(tokens):
            row = b * batch_stride + t * token_stride
            for h in range(heads):
                base = row + h * dim
                # the roll as two halves, not an index modulo dim: the loops vectorise (the same elements and bits;
                # bf16 at 32 rows 0.54x the time)
                for d in range(half):
                    out[b, h, t, d] = rotated(x[base + d], cos[c, t, d], x[base + d + half], sin[c, t, d])
                for d in range(half, dim):
                    out[b, h, t, d] = rotated(x[base + d], cos[c, t, d], x[base + d - half], sin[c, t, d])


# The entry points by dtype, every tensor by its address: module functions, so numba caches them (a closure
# over the pointer type would be compiled again in every process, ~0.8 s of start-up).
def _rotate_float32(x_address, batch_stride, token_stride, cos_address, sin_address, cos_batch, batch, tokens, heads,
                    dim, out_address):  # pragma: no cover - numba compiles it
    x_length, table = (batch - 1) * batch_stride + (tokens - 1) * token_stride + heads * dim, (cos_batch, tokens, dim)
    _rotate(numba.carray(float32_pointer(x_address), (x_length,)), numba.carray(float32_pointer(cos_address), table),
            numba.carray(float32_pointer(sin_address), table),
            numba.carray(float32_pointer(out_address), (batch, heads, tokens, dim)), batch_stride, token_stride)


def _rotate_bfloat16(x_address, batch_stride, token_stride, cos_address, sin_address, cos_batch, batch, tokens, heads,
                     dim, out_address):  # pragma: no cover - numba compiles it
    x_length, table = (batch - 1) * batch_stride + (tokens - 1) * token_stride + heads * dim, (cos_batch, tokens, dim)
    _rotate(numba.carray(bf16_pointer(x_address), (x_length,)), numba.carray(bf16_pointer(cos_address), table),
            numba.carray(bf16_pointer(sin_address), table),
            numba.carray(bf16_pointer(out_address), (batch, heads, tokens, dim)), batch_stride, token_stride)


if NUMBA:
    _rotate = numba.njit(cache=True, inline="always")(_rotate)
rotate_heads = _rotate  # for other kernels that rotate inside their call (kernels/cpu/layer_chain.py)


def _compile() -> dict[torch.dtype, Any]:
    compiled = {torch.float32: numba.njit(cache=True, nogil=True)(_rotate_float32),
                torch.bfloat16: numba.njit(cache=True, nogil=True)(_rotate_bfloat16)}
    generator = torch.Generator().manual_seed(0)
    for dtype, function in compiled.items():  # compile now, and check against torch's ops
        stacked = torch.randn(2, 3, 5 * 8, generator=generator).to(dtype)
        cos, sin = (torch.randn(2, 1, 3, 8, generator=generator).to(dtype) for _ in range(2))
        x = stacked[..., :4 * 8].view(2, 3, 4, 8).transpose(1, 2)
        want = x * cos + x.roll(4, -1) * sin
        got = _call(function, stacked, 4, 8, cos, sin)
        if not torch.equal(got, want):
            raise RuntimeError(f"its {dtype} result is not torch's")
    return compiled


_compiled = CompiledOnce(_compile, "rotary kernel unavailable, torch's ops rotate")


def kernel() -> dict[torch.dtype, Any] | None:
    """The compiled kernels by dtype, or None where numba is missing or a check failed (logged once)."""
    return _compiled.get()


def _call(function: Any, stacked: torch.Tensor, heads: int, dim: int, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    batch, tokens = stacked.shape[0], stacked.shape[1]
    out = torch.empty((batch, heads, tokens, dim), dtype=stacked.dtype)
    function(stacked.data_ptr(), stacked.stride(0), stacked.stride(1), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
             batch, tokens, heads, dim, out.data_ptr())
    return out


def rotate(stacked: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`x * cos + roll(x, dim / 2) * sin` for x the first `heads` heads of `stacked` ([batch, tokens, >= heads *
    dim], its last dimension contiguous), as heads: [batch, heads, tokens, dim] contiguous; cos and sin [batch or
    1, 1, tokens, dim], contiguous, of stacked's dtype. None where the kernel does not take them (torch's ops
    then)."""
    compiled = _compiled.get()
    if (compiled is None or stacked.dtype not in compiled or stacked.dim() != 3 or stacked.stride(-1) != 1
            or stacked.shape[-1] < heads * dim or not stacked.is_cpu or dim % 2
            or stacked.shape[0] * stacked.shape[1] * heads * dim > MAX_ELEMENTS):
        return None
    batch, tokens = stacked.shape[0], stacked.shape[1]
    for table in (cos, sin):
        if (table.dtype != stacked.dtype or table.shape[1:] != (1, tokens, dim) or table.shape[0] not in (1, batch)
                or not table.is_contiguous()):
            return None
    return _call(compiled[stacked.dtype], stacked, heads, dim, cos, sin)
