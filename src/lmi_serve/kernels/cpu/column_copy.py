"""A decode step's new K and V column copied into a slot part's buffers in one numba call (kv/slot_part.py).

`store[:rows, :, end:end + 1] = states` for K and then V is two torch indexing assignments (three slices
and a copy each, ~1.8 µs) a layer and step; this copies both columns by address in ~1 µs, the same bits
(elements moved, not computed).
"""

from __future__ import annotations

from typing import Any

import torch

from lmi_serve.kernels.cpu.numba_bits import NUMBA, CompiledOnce

if NUMBA:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import bf16_pointer, float32_pointer


def _copy(source, row_stride, head_stride, dim_stride, target, rows, heads, dim, target_row, target_head,
          column):  # pragma: no cover - numba compiles it
    for r in range(rows):
        for h in range(heads):
            at, to = r * row_stride + h * head_stride, r * target_row + h * target_head + column * dim
            for d in range(dim):
                target[to + d] = source[at + d * dim_stride]


def _entry(pointer):
    """K's and V's columns in one call, for the elements `pointer` reads (16 bits: bf16, fp16; fp32)."""
    copy = numba.njit(inline="always")(_copy)

    def both(key, key_strides, value, value_strides, rows, heads, dim, key_store, value_store, capacity, column):
        target_head = capacity * dim
        target_row, extent = heads * target_head, rows * heads * capacity * dim
        for address, (row_stride, head_stride, dim_stride), store in ((key, key_strides, key_store),
                                                                      (value, value_strides, value_store)):
            length = (rows - 1) * row_stride + (heads - 1) * head_stride + (dim - 1) * dim_stride + 1
            copy(numba.carray(pointer(address), (length,)), row_stride, head_stride, dim_stride,
                 numba.carray(pointer(store), (extent,)), rows, heads, dim, target_row, target_head, column)

    return numba.njit(nogil=True)(both)


def _compile() -> dict[int, Any]:
    return {2: _entry(bf16_pointer), 4: _entry(float32_pointer)}


_compiled = CompiledOnce(_compile, "K/V column copy unavailable, torch copies")


def kernel() -> dict[int, Any] | None:
    """The compiled copies by element size (2 or 4 bytes), or None where numba is missing (logged once)."""
    return _compiled.get()


def copy_column(key_store: torch.Tensor, value_store: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                column: int) -> bool:
    """`store[:rows, :, column] = states[:, :, 0]` for K and V (states [rows, heads, 1, dim] of the stores' dtype
    on the CPU; stores contiguous [>= rows, heads, > column, dim], as a slot part's are); False (nothing
    copied) where the kernel is missing or the element size is another."""
    compiled = _compiled.get()
    copy = None if compiled is None else compiled.get(key.element_size())
    if copy is None:
        return False
    rows, heads, _, dim = key.shape
    k_strides, v_strides = key.stride(), value.stride()
    copy(key.data_ptr(), (k_strides[0], k_strides[1], k_strides[3]), value.data_ptr(),
         (v_strides[0], v_strides[1], v_strides[3]), rows, heads, dim, key_store.data_ptr(), value_store.data_ptr(),
         key_store.shape[2], column)
    return True
