"""Slot KV cache (`option.kv_cache=slots`): the left-padded layout of kv_dynamic.py, kept in
preallocated buffers that a decode step writes one column into, in place.

transformers' `DynamicCache` concatenates every layer's whole K and V with the new column at every
step, so a step copies the entire cache (46 KB per token per row for SmolLM2); here each layer owns
buffers `[row capacity, kv heads, length capacity, head dim]` and a step writes `[rows, kv heads, 1,
head dim]` into the next column, returning views of the columns in use. The layout is exactly
DynamicKV's (rows right-aligned at a shared column cursor, padding masked on the left, per-row
position ids), so the logits are the same, bit for bit, and everything kv_dynamic.py's docstring
says about windows holds here too. Rows still join and leave by copying (`extend`, `keep`), as
often as requests start and end, not once per step.

Capacity grows when needed (rows in steps of 8, columns doubling, at least 256), and the buffers are
freed with the batch when its last row leaves; so memory is bounded by the largest batch and the
longest sequence actually served, at most max_rolling_batch_size x max_model_len (`slot_bytes`).
Columns that no row uses are masked; they hold finite values (zeros, or an earlier row's K/V), so
masking removes them exactly. Every buffer is made and changed under `torch.inference_mode()`: a
buffer grown inside a forward is an inference tensor, which torch lets no one change outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .kv import Prefilled
from .kv_dynamic import DynamicKV, leading_padding

ROW_STEP = 8  # row capacity grows in multiples of this
MIN_COLUMNS = 256  # column capacity: at least this, doubling as sequences grow


def _grown(capacity: int, needed: int, step: int) -> int:
    """A new capacity >= needed: doubling from `capacity`, rounded up to a multiple of `step`."""
    target = max(needed, 2 * capacity, step)
    return -(-target // step) * step


class SlotLayer(DynamicLayer):
    """One layer's K/V in buffers; rows [0, rows) and columns [0, length) are in use, and `keys` /
    `values` are views of exactly those (transformers and the engine read them as DynamicLayer's)."""

    @torch.inference_mode()
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.rows, self.length = 0, 0  # the first update or append brings the rows
        self.key_store = self._zeros(key_states, key_states.shape[0], 0)
        self.value_store = self._zeros(value_states, value_states.shape[0], 0)
        self.is_initialized = True
        self._refresh()

    @staticmethod
    def _zeros(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        rows = _grown(0, rows, ROW_STEP)
        columns = _grown(0, columns, MIN_COLUMNS)
        return torch.zeros((rows, like.shape[1], columns, like.shape[3]), dtype=like.dtype, device=like.device)

    def _refresh(self) -> None:
        self.keys = self.key_store[:self.rows, :, :self.length]
        self.values = self.value_store[:self.rows, :, :self.length]

    @torch.inference_mode()
    def reserve(self, rows: int, columns: int) -> None:
        """Make room for `rows` rows and `columns` columns, keeping what is in use."""
        have_rows, have_columns = self.key_store.shape[0], self.key_store.shape[2]
        if rows <= have_rows and columns <= have_columns:
            return
        shape = list(self.key_store.shape)
        shape[0] = have_rows if rows <= have_rows else _grown(have_rows, rows, ROW_STEP)
        shape[2] = have_columns if columns <= have_columns else _grown(have_columns, columns, MIN_COLUMNS)
        for name in ("key_store", "value_store"):
            old = getattr(self, name)
            new = torch.zeros(shape, dtype=old.dtype, device=old.device)
            new[:self.rows, :, :self.length] = old[:self.rows, :, :self.length]
            setattr(self, name, new)

    @torch.inference_mode()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns of every row in place; return the views of the columns in use."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.rows == 0 and self.length == 0:
            self.rows = key_states.shape[0]
            self.reserve(self.rows, 0)
        if key_states.shape[0] != self.rows:
            raise ValueError(f"slot layer holds {self.rows} rows, the forward fed {key_states.shape[0]}")
        end = self.length + key_states.shape[2]
        self.reserve(self.rows, end)
        self.key_store[:self.rows, :, self.length:end] = key_states
        self.value_store[:self.rows, :, self.length:end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    @torch.inference_mode()
    def select(self, index: torch.Tensor, first: int) -> None:
        """Keep the rows at `index`, in that order, and the columns from `first` on. An index may
        repeat (beam search replicates a row): the kept rows are gathered into copies first."""
        keys, values = self.key_store[index, :, first:self.length], self.value_store[index, :, first:self.length]
        self.reserve(len(index), self.length)
        self.rows, self.length = len(index), self.length - first
        self.key_store[:self.rows, :, :self.length] = keys
        self.value_store[:self.rows, :, :self.length] = values
        self._refresh()

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows whose K/V are `keys`/`values` ([rows, heads, length, dim]), right-aligned with the
        rows here at the shared column cursor (the shorter side gains padding on the left)."""
        width = max(self.length, keys.shape[2])
        self.reserve(self.rows + keys.shape[0], width)
        shift = width - self.length
        if shift:  # the rows here move right; the columns they free are padding (masked)
            for store in (self.key_store, self.value_store):
                store[:self.rows, :, shift:width] = store[:self.rows, :, :self.length].clone()
        start, end = self.rows, self.rows + keys.shape[0]
        self.key_store[start:end, :, width - keys.shape[2]:width] = keys
        self.value_store[start:end, :, width - keys.shape[2]:width] = values
        self.rows, self.length = end, width
        self._refresh()


class SlotCache(DynamicCache):
    """A DynamicCache whose layers are SlotLayers (created as the forward reaches them)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = SlotLayer


def _adopt(source: DynamicCache) -> SlotCache:
    """A SlotCache holding a copy of `source`'s layers."""
    cache = SlotCache()
    for layer in source.layers:
        slot = SlotLayer()
        if layer.is_initialized and layer.keys.numel():
            slot.lazy_initialization(layer.keys, layer.values)
            slot.append(layer.keys, layer.values)
        cache.layers.append(slot)
    return cache


class SlotKV(DynamicKV):
    """DynamicKV's bookkeeping (mask, positions, pending tokens) over a SlotCache: only the storage
    of K/V differs, so the forward and its logits are the same."""

    @classmethod
    def prefill(cls, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False) -> Prefilled:
        """The `KVFactory`: DynamicKV's prefill, its cache then moved into slot buffers."""
        out = DynamicKV.prefill(model, prompts, pad_id=pad_id, device=device, prompt_logits=prompt_logits)
        dynamic = out.kv
        kv = cls(model, _adopt(dynamic.cache), dynamic.mask, dynamic.next_pos, dynamic.pending)
        return Prefilled(kv, out.logits, out.prompt_logits, out.seen)

    @staticmethod
    def _empty_cache() -> SlotCache:
        return SlotCache()

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the rows at `indices`, then drop leading columns that became padding in every row."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        first = leading_padding(mask)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.select(index, first)
        self.mask = mask[:, first:]
        self.next_pos, self.pending = self.next_pos[index], self.pending[index]

    def extend(self, other: "SlotKV") -> None:
        """Append `other`'s rows, right-aligned at the shared column cursor."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if theirs.is_initialized:  # a layer that reuses another's KV (Gemma 3n) keeps none
                if not mine.is_initialized:
                    mine.lazy_initialization(theirs.keys, theirs.values)
                mine.append(theirs.keys, theirs.values)
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.pending = torch.cat([self.pending, other.pending])


def slot_bytes(model: Any, rows: int, columns: int) -> int:
    """The most the slot buffers of `rows` rows of `columns` tokens take (K and V, every layer)."""
    config = model.config.get_text_config(decoder=True)
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * layers * rows * heads * columns * head_dim * element
