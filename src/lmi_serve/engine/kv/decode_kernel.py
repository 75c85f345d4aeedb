"""Decode attention on the CPU in fp32: one query per row, K/V read once per K/V head, in a numba kernel.

torch's CPU SDPA (its flash kernel) runs a decode step's attention at about a third of the memory
bandwidth once the K/V cache is out of the CPU's caches, as it is in a model's step (the weights stream
through between two layers): 32 rows of 200 tokens took 19-20 ms a step over SmolLM2's 30 layers,
where reading their K/V takes ~6. This kernel gives each (row, K/V head) to one task that goes once
over the columns, scoring the head's query group against each column's key and summing its value
under an online softmax (running maximum and sums, rescaled when a column beats the best score), so
each key and value is read once, the two as parallel streams, and masked columns are skipped (a
left-padded row pays nothing for its padding). 12.5 against SDPA's 18.6 ms in that step.

It is also exactly batch-invariant: a row's result depends on its own query, columns and mask only,
never on its neighbours or on how much padding the batch gives it (SDPA's blocks shift with the padding).

Used by kv/slot_attention.py's `decode_attention` when `eligible` (fp32 on the CPU, one query per row,
a boolean or no mask, K/V laid out as the slot and dynamic caches keep them; at one to three rows of a
short context it is level with SDPA, at long ones faster) and the model's `option.decode_attention` is
`auto`; everything else stays on SDPA. numba's parallel loops run on its OpenMP threading layer; where
that cannot load (no libgomp), or numba is missing, `kernel()` is None and SDPA runs. Compiled once per
machine (cached beside this file or in numba's cache directory)."""

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


try:
    import numba
except ImportError:  # pragma: no cover - a dependency; without it SDPA attends
    numba = None

_FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: scores start at -inf


def _attend_kernel(q, keys, values, first, allowed, scale, out):  # pragma: no cover - numba compiles it
    rows, heads, groups, dim = q.shape
    columns = allowed.shape[1]
    for task in numba.prange(rows * heads):
        b = task // heads
        h = task % heads
        m = b if allowed.shape[0] > 1 else 0
        scaled = np.empty((groups, dim), dtype=np.float32)
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
            key = keys[b, h, first + t]
            value = values[b, h, first + t]
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
    # compile now (start-up, not a request's step) and check that the OpenMP layer loaded
    q = np.zeros((1, 1, 1, 8), np.float32)
    kv = np.zeros((1, 1, 2, 8), np.float32)
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
            and query.dtype == key.dtype == value.dtype == torch.float32
            and key.shape == value.shape and key.shape[0] == rows and query_heads % key.shape[1] == 0
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, rows)
                                  and mask.shape[1] == mask.shape[2] == 1 and mask.shape[3] == key.shape[2])))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """Attention of `query` [rows, query heads, 1, dim] over `key`/`value` [rows, K/V heads, T, dim]
    (query head i reads K/V head i // groups), `mask` [rows or 1, 1, 1, T] True where a row attends;
    returns [rows, 1, query heads, dim] (the layout attention functions return), or None when the
    kernel is unavailable or the K/V are not laid out for it (the caller attends with SDPA)."""
    compiled = kernel()
    keys, values = _buffer(key), _buffer(value)
    if compiled is None or keys is None or values is None or keys[1] != values[1]:
        return None
    rows, query_heads, _, dim = query.shape
    heads = key.shape[1]
    q = query.reshape(rows, heads, query_heads // heads, dim).contiguous()
    allowed = (torch.ones((1, key.shape[2]), dtype=torch.bool) if mask is None
               else mask[:, 0, 0, :].contiguous())
    out = torch.empty((rows, 1, query_heads, dim), dtype=query.dtype)
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # per calling thread
    compiled(q.numpy(), keys[0].numpy(), values[0].numpy(), keys[1], allowed.numpy(), np.float32(scale),
             out.numpy())
    return out
