"""One part of a slot KV cache (kv/slots.py): a layer's K and V for a run of consecutive batch rows, in
preallocated buffers `[row capacity, kv heads, length capacity, head dim]` whose columns [start, end) are
in use, right-aligned with the batch's other parts at the shared column cursor. A step writes its column
in place; rows leave by one row's copy each (`select`), join by writing only their own rows (`append`),
and the buffers are remade (rows in steps of ROW_STEP, columns doubling from MIN_COLUMNS) only when full.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmi_serve.kernels.cpu.column_copy import copy_column

ROW_STEP = 8  # row capacity grows in multiples of this
MIN_COLUMNS = 256  # column capacity: at least this, doubling as sequences grow
DIRECT_MOVES = 4  # rows moved by a `select` one copy each (an eviction's few); more, or overlapping: gathered first


def new_buffer(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Uninitialised storage: only what a part writes (K/V, and zeros for a joiner's padding) is read."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def grown(capacity: int, needed: int, step: int) -> int:
    """A new capacity >= needed: doubling from `capacity`, rounded up to a multiple of `step`."""
    target = max(needed, 2 * capacity, step)
    return -(-target // step) * step


class SlotPart:
    """One part's K/V in buffers; rows [0, rows) and columns [start, end) are in use, and `keys` /
    `values` are views of exactly those. Columns that became padding in every row are dropped by
    moving `start` (no copy); a write that would pass the buffer's end compacts or grows it."""

    def __init__(self, like: torch.Tensor, rows: int, columns: int):
        shape = (rows, like.shape[1], grown(0, columns, MIN_COLUMNS), like.shape[3])
        with torch.inference_mode():
            self.key_store = new_buffer(shape, like)
            self.value_store = new_buffer(shape, like)
        self.rows, self.start, self.end = 0, 0, 0
        self._refresh()

    @property
    def length(self) -> int:
        return self.end - self.start

    def _refresh(self) -> None:
        self.keys = self.key_store[:self.rows, :, self.start:self.end]
        self.values = self.value_store[:self.rows, :, self.start:self.end]

    @torch.inference_mode()
    def reserve(self, rows: int, columns: int) -> None:
        """Make room for `rows` rows and `columns` columns from `start`, keeping what is in use (moved to
        column 0 when the buffers are remade)."""
        have_rows, have_columns = self.key_store.shape[0], self.key_store.shape[2]
        if rows <= have_rows and self.start + columns <= have_columns:
            return
        shape = list(self.key_store.shape)
        shape[0] = have_rows if rows <= have_rows else grown(have_rows, rows, ROW_STEP)
        shape[2] = have_columns if columns <= have_columns else grown(have_columns, columns, MIN_COLUMNS)
        length = self.length
        for name in ("key_store", "value_store"):
            old = getattr(self, name)
            new = new_buffer(shape, old)
            new[:self.rows, :, :length] = old[:self.rows, :, self.start:self.end]
            setattr(self, name, new)
        self.start, self.end = 0, length

    def write_column(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` of a decode step's one column (key and value [rows, heads, 1, dim] on the CPU, rows the part's,
        inside a forward's inference mode) by address where the buffers have room (kernels/cpu/column_copy.py): ~3
        against ~9 µs a layer; else `write`."""
        end, store = self.end, self.key_store
        if not self.rows or end >= store.shape[2] or not copy_column(store, self.value_store, key, value, end):
            return self.write(key, value)
        self.end = end + 1
        # the views in use: as_strided is one call where slicing is two (~1 against ~2 µs each)
        shape, stride, offset = (self.rows, store.shape[1], end + 1 - self.start, store.shape[3]), store.stride(), \
            self.start * store.shape[3]
        self.keys = store.as_strided(shape, stride, offset)
        self.values = self.value_store.as_strided(shape, stride, offset)
        return self.keys, self.values

    @torch.inference_mode()
    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns of every row in place; return the views of the columns in use."""
        if self.rows == 0 and self.length == 0:
            self.rows = key_states.shape[0]
            self.reserve(self.rows, 0)
        if key_states.shape[0] != self.rows:
            raise ValueError(f"slot part holds {self.rows} rows, the forward fed {key_states.shape[0]}")
        columns = key_states.shape[2]
        self.reserve(self.rows, self.length + columns)
        self.key_store[:self.rows, :, self.end:self.end + columns] = key_states
        self.value_store[:self.rows, :, self.end:self.end + columns] = value_states
        self.end += columns
        self._refresh()
        return self.keys, self.values

    @torch.inference_mode()
    def select(self, rows: int, targets: torch.Tensor | None, sources: torch.Tensor | None, first: int,
               pairs: Sequence[tuple[int, int]] = ()) -> None:
        """Keep `rows` rows, row `targets[i]` becoming a copy of row `sources[i]` (gathered first, so a
        source may be a target too, or repeat: beam search replicates a row) and every other row staying
        where it is; drop the columns before `first` (of those in use) by moving `start`. A row leaving
        thus costs one row's copy when the caller fills its place with the part's last row
        (SlotKV.eviction_order), and a longest row leaving costs none. The caller makes `targets` and
        `sources` from Python lists: reading them from the device would be a host sync per layer on a GPU;
        `pairs`, the same moves as (target, source) ints, lets a few moves in which no row takes part twice
        copy each row once, straight to its place (a row leaving 32: keep() 1.13 ms against the gather's 1.66,
        benchmarks/bench_slot_moves.py)."""
        self.start += first
        self.reserve(rows, self.length)
        if pairs and len(pairs) <= DIRECT_MOVES and not {t for t, _ in pairs} & {s for _, s in pairs}:
            for target, source in pairs:  # no row is both: each moves straight to its place, one copy
                for store in (self.key_store, self.value_store):
                    store[target, :, self.start:self.end].copy_(store[source, :, self.start:self.end])
        elif targets is not None and len(targets):
            keys = self.key_store[sources, :, self.start:self.end]
            values = self.value_store[sources, :, self.start:self.end]
            self.key_store[targets, :, self.start:self.end] = keys
            self.value_store[targets, :, self.start:self.end] = values
        self.rows = rows
        self._refresh()

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows whose K/V are `keys`/`values` ([rows, heads, length, dim]), right-aligned with the
        rows here at the shared column cursor (the shorter side gains padding on the left). The rows here
        stay where they are when the columns left of their window can take a longer joiner's extra
        columns (or none are needed): a join then writes the joiners' rows only, where moving the rows
        here to column 0 first copied every row's K/V at each join (a full cache copy per layer)."""
        width = max(self.length, keys.shape[2])
        shift = width - self.length
        self.reserve(self.rows + keys.shape[0], self.length)  # rows only: may compact, which sets start 0
        if shift > self.start:
            self._append_from_column_0(width, shift)
        if shift:  # the columns the window gains on the left are padding for the rows here: zeroed
            for store in (self.key_store, self.value_store):
                store[:self.rows, :, self.start - shift:self.start] = 0
            self.start -= shift
        start, end, pad = self.rows, self.rows + keys.shape[0], width - keys.shape[2]
        first = self.start
        self.key_store[start:end, :, first + pad:first + width] = keys
        self.value_store[start:end, :, first + pad:first + width] = values
        if pad:  # the new rows' left padding is read (masked): it must hold finite values
            self.key_store[start:end, :, first:first + pad] = 0
            self.value_store[start:end, :, first:first + pad] = 0
        self.rows = end
        self._refresh()

    def _append_from_column_0(self, width: int, shift: int) -> None:
        """A joiner longer than the window by more than the columns left of it: the rows here move to
        column `shift` (the buffers made `width` wide), so that `append` finds `shift` columns at their left."""
        self.reserve(self.rows, width)
        length = self.length
        for store in (self.key_store, self.value_store):
            store[:self.rows, :, shift:shift + length] = store[:self.rows, :, self.start:self.end].clone()
        self.start, self.end = shift, shift + length
