"""Decode attention on the CPU: one query per row, K/V read once per K/V head, in a numba kernel.

torch's CPU SDPA (its flash kernel) runs a decode step's attention at about a third of the memory
bandwidth once the K/V cache is out of the CPU's caches, as it is in a model's step (the weights stream
through between two layers): 32 rows of 200 tokens took 19-20 ms a step over SmolLM2's 30 layers,
where reading their K/V takes ~6. This kernel gives each (row, K/V head) to one task that goes once
over the columns in blocks of BLOCK: it scores the head's query group against the block's keys, turns
the scores into weights against the best score so far (the sums so far rescaled when the block beats
it: an online softmax by blocks), and sums the block's values under them. Each key and value is read
from the cache where it lies (once a query head; a block's are in L1 for the next) and masked columns' values
are never read (a left-padded row pays nothing for its padding). The exps are plain arithmetic (`_exp`, within
3e-7 relative), so a block's vectorise. 12.5 against SDPA's 18.6 ms in that step when it went column by column;
by blocks, one row of 200 tokens (SmolLM2's 9 query heads) 16-17 µs a call against 18.5 column by column and
SDPA's 24.

The loops are written in 16-lane vectors (numba_bits' `load16` and the FMA intrinsics), not left to LLVM's
vectoriser: a score is 16 lanes of products summed over the head dim then once across the lanes, and a
block's values are summed 64 dims at a time in four vectors that stay in registers over the block (the
vectoriser kept the sums in memory, a load and store a value). bf16 K/V are widened as they are loaded. With
numpy arrays and scalar loops the kernel took 1.3-1.6x as long (journal, 2026-12-07: bf16, 32 rows of 170
columns, 314 against 190 µs a call in cache, 402 against 318 out of it). A head dim that is not a multiple of 16
(a tiny test model's 8) has its last dims summed one by one.

K/V in fp32 or bf16 (option.dtype=bf16): a bf16 column is widened to fp32 as it is loaded (its 16 bits are
the top of an fp32's), and the arithmetic is fp32 either way; a bf16 model's query comes in widened and
its output goes back rounded to bf16, as SDPA's bf16 kernel accumulates in fp32 too.

It is also exactly batch-invariant: a row's result depends on its own query, columns and mask only,
never on its neighbours or on how much padding the batch gives it (its blocks start at its own first
column; SDPA's blocks shift with the padding).

Used by kv/slot_attention.py's `decode_attention` when `eligible` (fp32 or bf16 on the CPU, one query per
row, a boolean or no mask, K/V laid out as the slot and dynamic caches keep them)
and the model's `option.decode_attention` is `auto`; everything else stays on SDPA. Every tensor goes to the
kernel by its address and layout in integers: a numpy view made per tensor and call cost ~10 µs a call (bf16, one row),
more than SDPA's lead at one or two rows. numba's parallel loops run on its OpenMP threading layer; where
that cannot load (no libgomp), or numba is missing, `kernel()` is None and SDPA runs. Compiled once per
machine and K/V dtype (cached beside this file or in numba's cache directory)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from lmi_serve.kernels.host import omp_threads, require_omp_layer
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce


_EXP_FLOOR = -87.0  # exp below this is a float32 denormal, whose products are slow: counted as 0
BLOCK = 64  # columns scored, then weighted, then summed together: the exps of a block vectorise


DTYPES = (torch.float32, torch.bfloat16)  # the K/V dtypes it reads; the arithmetic is fp32

try:
    import numba
    from numba.core import types
    from numba.extending import overload

    from lmi_serve.kernels.cpu.bf16_ir import fma_scalar, fma_vector
    from lmi_serve.kernels.cpu.numba_bits import (bf16, bf16_pointer, bits_float, byte_pointer, float32_pointer, held,
                                                  load16, match_torch_threads, prefetch, store16, sum16, times16,
                                                  widen, zeros16)
except ImportError:  # pragma: no cover - a dependency; without it SDPA attends
    numba = None

_FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: scores start at -inf


def as_float(element):  # pragma: no cover - numba compiles its overload below
    """One element as fp32: itself, or a bf16 one's bits widened."""
    raise NotImplementedError


def stored(value, like):  # pragma: no cover - numba compiles its overload below
    """An fp32 result as an element of the array `like`: itself, or rounded once to bf16 bits."""
    raise NotImplementedError


if numba is not None:
    @overload(as_float, inline="always")
    def _as_float(element):
        return (lambda element: widen(element)) if element == types.uint16 else (lambda element: element)

    @overload(stored, inline="always")
    def _stored(value, like):
        return (lambda value, like: bf16(value)) if like.dtype == types.uint16 else (lambda value, like: value)


def _exp(x):  # pragma: no cover - numba compiles it
    """exp(x) for x <= 0 within 3e-7 relative (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times
    2^n made from its bits; fastmath may reassociate the reduction), 0 below _EXP_FLOOR: plain arithmetic, so a loop of them vectorises (numba's np.exp
    is a libm call per element without Intel's SVML, not installed here)."""
    y = max(x, np.float32(_EXP_FLOOR))  # no branch before the select at the end: the loop vectorises
    n = np.floor(y * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (y - n * np.float32(0.693359375)) - n * np.float32(-2.12194440e-4)  # ln 2 in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e = (p * r * r + r + np.float32(1.0)) * bits_float(np.uint32(np.int32(n) + np.int32(127)) << 23)
    return e if x > np.float32(_EXP_FLOOR) else np.float32(0.0)  # -inf (a masked column) too


def _attend_rows(q, q_row, q_head, query_heads, keys, values, rows, heads, capacity, dim, first, columns, mask,
                 mask_row, mask_column, masked, scale, out):  # pragma: no cover - numba compiles it
    """Each (row b, K/V head h) one task: its queries q[b * q_row + query head * q_head + d], keys and values
    [rows, heads, capacity, dim] from column `first`, mask[b * mask_row + t * mask_column]
    (read where `masked`), out [rows, query heads, dim]. Pointers all: fp32, or bf16 as their bits."""
    groups = query_heads // heads
    for task in numba.prange(rows * heads):
        b = task // heads
        h = task % heads
        # the group's scaled queries and its sums so far [groups * dim], a block's scores (then weights)
        scaled = np.empty(groups * dim, dtype=np.float32)
        sums = np.zeros(groups * dim, dtype=np.float32)
        weights = np.empty((groups, BLOCK), dtype=np.float32)
        queries, summed = float32_pointer(scaled.ctypes.data), float32_pointer(sums.ctypes.data)
        for g in range(groups):
            for d in range(dim):
                scaled[g * dim + d] = as_float(q[b * q_row + (h * groups + g) * q_head + d]) * scale
        best = np.full(groups, -np.inf, dtype=np.float32)
        total = np.zeros(groups, dtype=np.float32)
        row = (b * heads + h) * capacity + first  # the row's column 0 in the K/V buffers
        lanes = dim - dim % 16  # the dims read 16 at a time
        # blocks start at the row's first column it attends: where they fall does not move with the padding a
        # batch gives the row, so neither do its bits
        start = 0
        while masked and start < columns and not mask[b * mask_row + start * mask_column]:
            start += 1
        for block in range(start, columns, BLOCK):
            n = min(BLOCK, columns - block)
            for g in range(groups):  # the block's scores: 16 lanes of products over the dims, then their sum
                for t in range(n):
                    key = (row + block + t) * dim
                    if g == 0:  # the column's value, fetched while its key is scored (0.9x out of cache)
                        for c in range(0, dim, 16):
                            prefetch(values, key + c)
                    product = zeros16()
                    for c in range(0, lanes, 16):
                        product = fma_vector(product, load16(queries, g * dim + c), load16(keys, key + c))
                    score = sum16(product)
                    for d in range(lanes, dim):  # a head dim not a multiple of 16: the rest one by one
                        score += scaled[g * dim + d] * as_float(keys[key + d])
                    weights[g, t] = score
            for t in range(n):  # a masked column's score is computed and dropped: its K/V may be anything
                if masked and not mask[b * mask_row + (block + t) * mask_column]:
                    for g in range(groups):
                        weights[g, t] = -np.inf
            for g in range(groups):  # softmax weights against the best score so far; the sums so far rescaled
                high = best[g]
                for t in range(n):
                    high = max(high, weights[g, t])
                if high == -np.inf:  # nothing attended yet
                    continue
                rescale = _exp(best[g] - high)
                best[g] = high
                mass = np.float32(0.0)
                for t in range(n):
                    weights[g, t] = _exp(weights[g, t] - high)
                    mass += weights[g, t]
                total[g] = total[g] * rescale + mass
                _add_values(weights[g], n, values, (row + block) * dim, dim, summed, g * dim, rescale)
        for g in range(groups):
            inverse = np.float32(1.0) / total[g] if total[g] > 0 else np.float32(0.0)
            at = (b * query_heads + h * groups + g) * dim
            for d in range(dim):
                out[at + d] = stored(sums[g * dim + d] * inverse, out)
        held(scaled)
        held(sums)


def _add_values(weights, n, values, first_value, dim, summed, at, rescale):  # pragma: no cover - numba compiles it
    """summed[at:at + dim] times rescale plus the block's n values [n, dim] from values[first_value] under their
    weights: 64 dims at a time in four vectors held in registers across the block (four sums in flight hide an
    FMA's latency), then what is left 16 at a time, then one by one. A zero weight (a masked column's) reads
    nothing."""
    quads = dim - dim % 64
    for c in range(0, quads, 64):
        s0, s1 = times16(load16(summed, at + c), rescale), times16(load16(summed, at + c + 16), rescale)
        s2, s3 = times16(load16(summed, at + c + 32), rescale), times16(load16(summed, at + c + 48), rescale)
        for t in range(n):
            weight = weights[t]
            if weight != 0:
                v = first_value + t * dim + c
                s0, s1 = fma_scalar(s0, load16(values, v), weight), fma_scalar(s1, load16(values, v + 16), weight)
                s2, s3 = (fma_scalar(s2, load16(values, v + 32), weight),
                          fma_scalar(s3, load16(values, v + 48), weight))
        store16(summed, at + c, s0)
        store16(summed, at + c + 16, s1)
        store16(summed, at + c + 32, s2)
        store16(summed, at + c + 48, s3)
    lanes = dim - dim % 16
    for c in range(quads, lanes, 16):
        s = times16(load16(summed, at + c), rescale)
        for t in range(n):
            if weights[t] != 0:
                s = fma_scalar(s, load16(values, first_value + t * dim + c), weights[t])
        store16(summed, at + c, s)
    for d in range(lanes, dim):  # a head dim not a multiple of 16: the rest one by one
        one = summed[at + d] * rescale
        for t in range(n):
            if weights[t] != 0:
                one += weights[t] * as_float(values[first_value + t * dim + d])
        summed[at + d] = one


if numba is not None:  # compiled lazily, inlined into the entry points below
    _exp = numba.njit(fastmath=_FLAGS, cache=True, inline="always")(_exp)
    _add_values = numba.njit(fastmath=_FLAGS, cache=True, inline="always")(_add_values)
    _attend_rows = numba.njit(fastmath=_FLAGS, cache=True, inline="always")(_attend_rows)


# Entry points by dtype: every tensor given by its address and layout in integers, not as numpy views (a view
# made and typed per call cost ~1 µs each, ~10 µs a call with the copies around it; 30 calls a step).
def _float32_kernel(q_address, q_row, q_head, query_heads, k_address, v_address, rows, heads, capacity, dim, first,
                    columns, mask_address, mask_row, mask_column, scale, out_address):  # pragma: no cover
    _attend_rows(float32_pointer(q_address), q_row, q_head, query_heads, float32_pointer(k_address),
                 float32_pointer(v_address), rows, heads, capacity, dim, first, columns, byte_pointer(mask_address),
                 mask_row, mask_column, mask_address != 0, scale, float32_pointer(out_address))


def _bfloat16_kernel(q_address, q_row, q_head, query_heads, k_address, v_address, rows, heads, capacity, dim, first,
                     columns, mask_address, mask_row, mask_column, scale, out_address):  # pragma: no cover
    _attend_rows(bf16_pointer(q_address), q_row, q_head, query_heads, bf16_pointer(k_address),
                 bf16_pointer(v_address), rows, heads, capacity, dim, first, columns, byte_pointer(mask_address),
                 mask_row, mask_column, mask_address != 0, scale, bf16_pointer(out_address))


def _compile() -> Any:
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
    compiled = {dtype: numba.njit(parallel=True, fastmath=_FLAGS, cache=True, nogil=True)(function)
                for dtype, function in ((torch.float32, _float32_kernel), (torch.bfloat16, _bfloat16_kernel))}
    for dtype in DTYPES:  # compile both now (start-up, not a request's step)
        kv = torch.zeros((1, 1, 2, 16), dtype=dtype)
        _attend(compiled, torch.zeros((1, 1, 1, 16), dtype=dtype), kv, kv, torch.ones((1, 1, 1, 2), dtype=torch.bool),
                1.0)
    require_omp_layer()
    return compiled


_compiled = CompiledOnce(_compile, "decode attention kernel unavailable, SDPA attends instead", logging.WARNING)


def kernel() -> Any | None:
    """The compiled kernels by dtype, or None where numba or its OpenMP layer is missing (logged once)."""
    return _compiled.get()


def _buffer(x: torch.Tensor) -> tuple[int, int, int] | None:
    """`x` [rows, heads, T, dim] as a C-contiguous [rows, heads, capacity, dim] buffer: (its address, capacity,
    the column where x starts in it), as the slot cache's views of its stores are (a plain tensor is its own
    buffer); None for another layout."""
    rows, heads, columns, dim = x.shape
    s_row, s_head, s_column, s_dim = x.stride()
    if s_dim != 1 or s_column != dim or s_head % dim or s_row != heads * s_head or s_head // dim < columns:
        return None
    capacity, offset = s_head // dim, x.storage_offset()
    first = (offset % s_head) // dim
    if first + columns > capacity or (offset - first * dim) % s_head:
        return None
    return x.data_ptr() - first * dim * x.element_size(), capacity, first


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    rows, query_heads, queries, dim = query.shape
    return (queries == 1 and query.device.type == "cpu" and key.shape[-1] == dim
            and query.dtype == key.dtype == value.dtype and key.dtype in DTYPES
            and key.shape == value.shape and key.shape[0] == rows and query_heads % key.shape[1] == 0
            and (mask is None or eligible_mask(mask, rows, key.shape[2])))


def eligible_mask(mask: torch.Tensor, rows: int, columns: int) -> bool:
    """A mask the kernel reads: boolean [rows or 1, 1, 1, columns]."""
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, rows)
            and mask.shape[1] == mask.shape[2] == 1 and mask.shape[3] == columns)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """Attention of `query` [rows, query heads, 1, dim] over `key`/`value` [rows, K/V heads, T, dim]
    (query head i reads K/V head i // groups), `mask` [rows or 1, 1, 1, T] True where a row attends;
    returns [rows, 1, query heads, dim] (the layout attention functions return), or None when the
    kernel is unavailable or the K/V are not laid out for it (the caller attends with SDPA). bf16 in, bf16
    out: the query widened, the output rounded once."""
    compiled = _compiled.value if _compiled.done else kernel()  # no lock once compiled: 30 calls a step
    return None if compiled is None else _attend(compiled, query, key, value, mask, scale)


def _attend(compiled: dict, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor | None:
    keys, values = _buffer(key), _buffer(value)
    if keys is None or values is None or keys[1:] != values[1:]:
        return None
    rows, query_heads, _, dim = query.shape
    heads, columns = key.shape[1], key.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    q_row, q_head = query.stride(0), query.stride(1)
    if mask is None:
        mask_address = mask_row = mask_column = 0
    else:
        mask_row, mask_column = (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(3)
        mask_address = mask.data_ptr()
    out = torch.empty((rows, 1, query_heads, dim), dtype=query.dtype)
    match_torch_threads()
    compiled[query.dtype](query.data_ptr(), q_row, q_head, query_heads, keys[0], values[0], rows, heads, keys[1], dim,
                          keys[2], columns, mask_address, mask_row, mask_column, np.float32(scale), out.data_ptr())
    return out
