"""Decode attention on the CPU: one query per row, K/V read once per K/V head, in a numba kernel.

torch's CPU SDPA (its flash kernel) runs a decode step's attention at about a third of the memory
bandwidth once the K/V cache is out of the CPU's caches, as it is in a model's step (the weights stream
through between two layers): 32 rows of 200 tokens took 19-20 ms a step over SmolLM2's 30 layers,
where reading their K/V takes ~6. This kernel gives each (row, K/V head) to one task that goes once
over the columns, scoring the head's query group against each column's key and summing its value
under an online softmax (running maximum and sums, rescaled when a column beats the best score), so
each key and value is read once, the two as parallel streams, and masked columns are skipped (a
left-padded row pays nothing for its padding). 12.5 against SDPA's 18.6 ms in that step.

K/V in fp32 or bf16 (option.dtype=bf16, from BF16_MIN_ROWS rows): a bf16 column is widened to fp32 as it
is read (its 16 bits are the top of an fp32's), and the arithmetic is fp32 either way; a bf16 model's
query comes in widened and its output goes back rounded to bf16, as SDPA's bf16 kernel accumulates in
fp32 too.

It is also exactly batch-invariant: a row's result depends on its own query, columns and mask only,
never on its neighbours or on how much padding the batch gives it (SDPA's blocks shift with the padding).

Used by kv/slot_attention.py's `decode_attention` when `eligible` (fp32 or bf16 on the CPU, one query per
row, a boolean or no mask, K/V laid out as the slot and dynamic caches keep them; at one or two rows of a
short context it is ~0.3-0.6 ms a SmolLM2 step slower than SDPA, at 4 level, at more rows and longer
contexts faster) and the model's `option.decode_attention` is
`auto`; everything else stays on SDPA. numba's parallel loops run on its OpenMP threading layer; where
that cannot load (no libgomp), or numba is missing, `kernel()` is None and SDPA runs. Compiled once per
machine and K/V dtype (cached beside this file or in numba's cache directory)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_EXP_FLOOR = -87.0  # exp below this is a float32 denormal, whose products are slow: counted as 0
_state: dict[str, Any] = {}
_lock = threading.Lock()


DTYPES = (torch.float32, torch.bfloat16)  # the K/V dtypes it reads; the arithmetic is fp32
# bf16 steps of fewer rows stay on SDPA: there it was faster (1 / 2 rows of 200 tokens, SmolLM2 bf16: 14.1 /
# 15.5 ms a step against the kernel's 15.4 / 16.0; level at 4; 36-41 against 42-46 at 32), and a bf16 row is
# not batch-invariant anyway (oneDNN's bf16 matmuls are not). fp32 takes the kernel at every size: it is.
BF16_MIN_ROWS = 4

try:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - a dependency; without it SDPA attends
    numba = None

_FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: scores start at -inf


def widened(column, into):  # pragma: no cover - numba compiles its overload below
    """A K or V column as fp32: itself when it is fp32; a bf16 one (its bits, uint16) widened into `into`."""
    raise NotImplementedError


if numba is not None:
    @intrinsic
    def _float_from_bits(typingctx, bits):
        """The fp32 whose bits are the low 32 of the integer `bits`, as a bitcast: numba has no scalar view."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
            return builder.bitcast(low, ir.FloatType())

        return types.float32(bits), codegen

    @overload(widened, inline="always")
    def _widened(column, into):
        if column.dtype == types.uint16:
            def widen_bf16(column, into):
                for d in range(column.shape[0]):
                    into[d] = _float_from_bits(np.uint32(column[d]) << 16)
                return into
            return widen_bf16
        return lambda column, into: column


def _attend_kernel(q, keys, values, first, allowed, scale, out):  # pragma: no cover - numba compiles it
    rows, heads, groups, dim = q.shape
    columns = allowed.shape[1]
    for task in numba.prange(rows * heads):
        b = task // heads
        h = task % heads
        m = b if allowed.shape[0] > 1 else 0
        # the scaled queries, then a bf16 key's and value's columns widened (unused for fp32 K/V): one allocation
        work = np.empty((groups + 2, dim), dtype=np.float32)
        scaled, key_in, value_in = work[:groups], work[groups], work[groups + 1]
        for g in range(groups):
            for d in range(dim):
                scaled[g, d] = q[b, h, g, d] * scale
        # one pass over the columns, each key read with its value (two streams from memory, not one after
        # the other): an online softmax, whose running sums are rescaled when a column beats the best score
        best = np.full(groups, -np.inf, dtype=np.float32)
        total = np.zeros(groups, dtype=np.float32)
        summed = np.zeros((groups, dim), dtype=np.float32)
        for t in range(columns):
            if not allowed[m, t]:
                continue
            key = widened(keys[b, h, first + t], key_in)
            value = widened(values[b, h, first + t], value_in)
            for g in range(groups):
                score = np.float32(0.0)
                for d in range(dim):
                    score += scaled[g, d] * key[d]
                if score > best[g]:
                    x = best[g] - score
                    rescale = np.exp(x) if x > np.float32(_EXP_FLOOR) else np.float32(0.0)
                    best[g] = score
                    total[g] = total[g] * rescale + np.float32(1.0)
                    for d in range(dim):
                        summed[g, d] = summed[g, d] * rescale + value[d]
                else:
                    x = score - best[g]
                    p = np.exp(x) if x > np.float32(_EXP_FLOOR) else np.float32(0.0)
                    total[g] += p
                    for d in range(dim):
                        summed[g, d] += p * value[d]
        for g in range(groups):
            inverse = np.float32(1.0) / total[g] if total[g] > 0 else np.float32(0.0)
            for d in range(dim):
                out[b, 0, h * groups + g, d] = summed[g, d] * inverse


def _compile() -> Any:
    if numba is None:
        raise RuntimeError("numba is not installed")
    # the workqueue layer's threads fight torch's OpenMP ones (a 32-row step 1.1-1.2x slower than SDPA's)
    numba.config.THREADING_LAYER = "omp"
    compiled = numba.njit(parallel=True, fastmath=_FLAGS, cache=True, nogil=True)(_attend_kernel)
    # compile both K/V dtypes now (start-up, not a request's step) and check that the OpenMP layer loaded
    q = np.zeros((1, 1, 1, 8), np.float32)
    for dtype in DTYPES:
        kv = _numpy(torch.zeros((1, 1, 2, 8), dtype=dtype))
        compiled(q, kv, kv, 0, np.ones((1, 2), np.bool_), np.float32(1.0), np.zeros((1, 1, 1, 8), np.float32))
    if numba.threading_layer() != "omp":
        raise RuntimeError(f"numba's threading layer is {numba.threading_layer()}, not omp")
    return compiled


def kernel() -> Any | None:
    """The compiled kernel, or None where numba or its OpenMP layer is missing (logged once)."""
    with _lock:
        if "kernel" not in _state:
            try:
                _state["kernel"] = _compile()
            except Exception as error:  # noqa: BLE001 - any failure means SDPA, said once
                log.warning("decode attention kernel unavailable, SDPA attends instead: %s", error)
                _state["kernel"] = None
        return _state["kernel"]


def _numpy(x: torch.Tensor) -> np.ndarray:
    """`x`'s memory as numpy: fp32 as it is, bf16 as its bits (uint16; numpy has no bf16)."""
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _buffer(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`x` [rows, heads, T, dim] as a C-contiguous [rows, heads, capacity, dim] buffer and the column
    where x starts in it (the slot cache's views of its stores; a plain tensor is its own buffer)."""
    rows, heads, columns, dim = x.shape
    s_row, s_head, s_column, s_dim = x.stride()
    if s_dim != 1 or s_column != dim or s_head % dim or s_row != heads * s_head or s_head // dim < columns:
        return None
    capacity, offset = s_head // dim, x.storage_offset()
    first = (offset % s_head) // dim
    if first + columns > capacity or (offset - first * dim) % s_head:
        return None
    return torch.as_strided(x, (rows, heads, capacity, dim), (s_row, s_head, dim, 1), offset - first * dim), first


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    rows, query_heads, queries, _ = query.shape
    return (queries == 1 and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype and key.dtype in DTYPES
            and (key.dtype == torch.float32 or rows >= BF16_MIN_ROWS)
            and key.shape == value.shape and key.shape[0] == rows and query_heads % key.shape[1] == 0
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, rows)
                                  and mask.shape[1] == mask.shape[2] == 1 and mask.shape[3] == key.shape[2])))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """Attention of `query` [rows, query heads, 1, dim] over `key`/`value` [rows, K/V heads, T, dim]
    (query head i reads K/V head i // groups), `mask` [rows or 1, 1, 1, T] True where a row attends;
    returns [rows, 1, query heads, dim] (the layout attention functions return), or None when the
    kernel is unavailable or the K/V are not laid out for it (the caller attends with SDPA). bf16 in, bf16
    out: the query widened, the output rounded once."""
    compiled = _state["kernel"] if "kernel" in _state else kernel()  # no lock once compiled: 30 calls a step
    keys, values = _buffer(key), _buffer(value)
    if compiled is None or keys is None or values is None or keys[1] != values[1]:
        return None
    # numpy, not torch, for the small arrays around the call: ~1 against ~2 µs an op, 30 calls a step
    rows, query_heads, _, dim = query.shape
    heads = key.shape[1]
    q = (query if query.dtype == torch.float32 else query.float()).numpy()
    q = np.ascontiguousarray(q.reshape(rows, heads, query_heads // heads, dim))
    allowed = (np.ones((1, key.shape[2]), dtype=np.bool_) if mask is None
               else np.ascontiguousarray(mask.numpy()[:, 0, 0, :]))
    out = np.empty((rows, 1, query_heads, dim), dtype=np.float32)
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # per calling thread
    compiled(q, _numpy(keys[0]), _numpy(values[0]), keys[1], allowed, np.float32(scale), out)
    result = torch.from_numpy(out)
    return result if query.dtype == torch.float32 else result.to(query.dtype)
