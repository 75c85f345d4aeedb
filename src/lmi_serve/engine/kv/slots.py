"""Slot KV cache (`option.kv_cache=slots`): the left-padded layout of kv/dynamic.py, kept in
preallocated buffers that a decode step writes one column into, in place, and split into parts so
rows of very different lengths neither copy nor attend over each other's columns.

transformers' `DynamicCache` concatenates every layer's whole K and V with the new column at every
step, so a step copies the entire cache (46 KB per token per row for SmolLM2); here each layer owns
buffers `[row capacity, kv heads, length capacity, head dim]` and a step writes `[rows, kv heads, 1,
head dim]` into the next column, returning views of the columns in use. The layout is DynamicKV's
(rows right-aligned at a shared column cursor, padding masked on the left, per-row position ids),
and everything kv/dynamic.py's docstring says about windows holds here too.

Parts: the batch's rows are consecutive runs ("parts"), each in its own buffers, right-aligned at
the same cursor: part p holds the last `len_p` columns of the batch's mask, enough for its longest
row. Rows that join (`extend`) arrive as new parts, without copying, and a part is merged into its
neighbour when the padding that adds is small (`MERGE_SLACK`); so a 2,000-token prompt joining 32
short rows neither widens their buffers (a copy of every row, seconds) nor makes every short row
attend over 2,000 columns at each step: with more than one part, the layers return `Parts` and
kv/slot_attention.py attends per part. A model whose attention is not SDPA keeps one part. One part
gives the DynamicCache's logits bit for bit; several give each row its own columns, equal to a
forward of that row alone within float rounding, as a different amount of padding does.

Capacity grows when needed (rows in steps of 8, columns doubling, at least 256), and a part's
buffers are freed when its last row leaves; so memory is bounded by the rows and longest sequences
actually served, at most max_rolling_batch_size x max_model_len (`slot_bytes`). Columns that no row
uses are masked; they hold finite values (zeros written as a joiner's padding, or an earlier row's
K/V), so masking removes them exactly. Capacity beyond the rows and columns in use is never read, so
new buffers are left uninitialised (`_new_buffer`): zero-filling every grown buffer took 6 % of the
engine thread at 32 streaming clients (py-spy), for memory no row had reached. Every buffer is made and changed under `torch.inference_mode()`: a buffer grown inside a
forward is an inference tensor, which torch lets no one change outside it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lmi_serve.engine.kv.dynamic import DynamicKV, DynamicLayout
from lmi_serve.engine.kv.protocol import Prefilled
from lmi_serve.engine.kv.slot_attention import Parts, attends_by_parts

ROW_STEP = 8  # row capacity grows in multiples of this
MIN_COLUMNS = 256  # column capacity: at least this, doubling as sequences grow
# Two neighbouring parts merge when that adds at most this many padded (row, column) cells, about
# what attending per part costs in calls (measured: a cell ~4 us a step over 30 layers, a part's
# extra calls ~1 ms); and never more than MAX_PARTS parts: the pair that adds least padding merges.
MERGE_SLACK = 256
MAX_PARTS = 6
DIRECT_MOVES = 4  # rows moved by a `select` one copy each (an eviction's few); more, or overlapping: gathered first


def _new_buffer(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Uninitialised storage: only what a part writes (K/V, and zeros for a joiner's padding) is read."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _grown(capacity: int, needed: int, step: int) -> int:
    """A new capacity >= needed: doubling from `capacity`, rounded up to a multiple of `step`."""
    target = max(needed, 2 * capacity, step)
    return -(-target // step) * step


class SlotPart:
    """One part's K/V in buffers; rows [0, rows) and columns [start, end) are in use, and `keys` /
    `values` are views of exactly those. Columns that became padding in every row are dropped by
    moving `start` (no copy); a write that would pass the buffer's end compacts or grows it."""

    def __init__(self, like: torch.Tensor, rows: int, columns: int):
        shape = (rows, like.shape[1], _grown(0, columns, MIN_COLUMNS), like.shape[3])
        with torch.inference_mode():
            self.key_store = _new_buffer(shape, like)
            self.value_store = _new_buffer(shape, like)
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
        shape[0] = have_rows if rows <= have_rows else _grown(have_rows, rows, ROW_STEP)
        shape[2] = have_columns if columns <= have_columns else _grown(have_columns, columns, MIN_COLUMNS)
        length = self.length
        for name in ("key_store", "value_store"):
            old = getattr(self, name)
            new = _new_buffer(shape, old)
            new[:self.rows, :, :length] = old[:self.rows, :, self.start:self.end]
            setattr(self, name, new)
        self.start, self.end = 0, length

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


class SlotLayer(DynamicLayer):
    """One layer's K/V as `parts` (SlotPart), consecutive runs of the batch's rows in order. With one
    part, `update` returns views of its columns in use, as DynamicLayer does; with several, `Parts`."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.parts = [SlotPart(key_states, key_states.shape[0], key_states.shape[2])]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.parts) == 1:
            return self.parts[0].write(key_states, value_states)
        sizes = [part.rows for part in self.parts]
        written = [part.write(k, v) for part, k, v in
                   zip(self.parts, key_states.split(sizes), value_states.split(sizes))]
        return Parts(k for k, _ in written), Parts(v for _, v in written)

    @property
    def keys(self) -> torch.Tensor:  # one part's view (DynamicLayer's attribute; several parts have no one tensor)
        return self._single().keys

    @keys.setter
    def keys(self, value) -> None:  # DynamicLayer.__init__ sets it; the parts own the storage
        pass

    @property
    def values(self) -> torch.Tensor:
        return self._single().values

    @values.setter
    def values(self, value) -> None:
        pass

    def _single(self) -> SlotPart:
        if len(self.parts) != 1:
            raise ValueError(f"this slot layer holds {len(self.parts)} parts, not one tensor")
        return self.parts[0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns of every part (DynamicLayer.crop's sign: the parts are
        right-aligned at the batch's cursor, so the batch's last columns are each part's last)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes the (negative) number of columns to remove")
        if not self.is_initialized:
            return
        for part in self.parts:
            part.end -= min(-tokens_to_remove, part.length)
            part._refresh()

    def get_seq_length(self) -> int:
        return max((part.length for part in self.parts), default=0) if self.is_initialized else 0

    def merge(self, first: int) -> None:
        """Merge part `first + 1` into part `first` (its rows after those of `first`)."""
        later = self.parts.pop(first + 1)
        self.parts[first].append(later.keys, later.values)


class SlotCache(DynamicCache):
    """A DynamicCache whose layers are SlotLayers (created as the forward reaches them)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = SlotLayer


def _adopt(source: DynamicCache) -> SlotCache:
    """A SlotCache holding a copy of `source`'s layers, one part each."""
    cache = SlotCache()
    for layer in source.layers:
        slot = SlotLayer()
        if layer.is_initialized and layer.keys.numel():
            slot.lazy_initialization(layer.keys, layer.values)
            slot.parts[0].append(layer.keys, layer.values)  # made to size: no growth
        cache.layers.append(slot)
    return cache


def merge_cost(rows: Sequence[int], lengths: Sequence[int], first: int) -> int:
    """Padded (row, column) cells that merging parts `first` and `first + 1` adds."""
    a, b = slice(first, first + 2), max(lengths[first:first + 2])
    return sum(rows[a]) * b - sum(r * n for r, n in zip(rows[a], lengths[a]))


def merges(rows: list[int], lengths: list[int], slack: int = MERGE_SLACK) -> list[int]:
    """Which neighbours to merge, in order (each entry: merge part i and i + 1, then renumber): any pair
    adding at most `slack` cells, then the cheapest pairs until at most MAX_PARTS remain."""
    rows, lengths, plan = list(rows), list(lengths), []
    while len(rows) > 1:
        costs = [merge_cost(rows, lengths, i) for i in range(len(rows) - 1)]
        best = min(range(len(costs)), key=costs.__getitem__)
        if costs[best] > slack and len(rows) <= MAX_PARTS:
            break
        plan.append(best)
        rows[best:best + 2] = [rows[best] + rows[best + 1]]
        lengths[best:best + 2] = [max(lengths[best:best + 2])]
    return plan


class SlotKV(DynamicKV):
    """DynamicKV's bookkeeping (mask, positions, pending tokens) over a SlotCache: only the storage
    of K/V (and, with several parts, which columns each row attends over) differs."""

    merge_slack = MERGE_SLACK

    @classmethod
    def prefill(cls, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        """DynamicKV's prefill (images included), its cache then moved into slot buffers."""
        out = DynamicKV.prefill(model, prompts, pad_id=pad_id, device=device, prompt_logits=prompt_logits,
                                model_inputs=model_inputs)
        dynamic = out.kv
        kv = cls(model, _adopt(dynamic.cache), dynamic.mask, dynamic.next_pos, dynamic.pending, dynamic.lengths)
        return Prefilled(kv, out.logits, out.prompt_logits, out.seen)

    @staticmethod
    def _empty_cache() -> SlotCache:
        return SlotCache()

    def _layers(self) -> list[SlotLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]

    def part_shapes(self) -> tuple[list[int], list[int]]:
        """(rows, columns) of each part, in row order."""
        layers = self._layers()
        parts = layers[0].parts if layers else []
        return [p.rows for p in parts], [p.length for p in parts]

    def held_bytes(self) -> int:
        """Bytes of the slot buffers, every part of every layer, spare rows and columns included."""
        return sum(part.key_store.nbytes + part.value_store.nbytes for layer in self._layers() for part in layer.parts)

    def _locate(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        """(part, row within it) of each of the batch's rows `rows`."""
        ends = list(itertools.accumulate(self.part_shapes()[0]))
        parts = [bisect.bisect_right(ends, row) for row in rows]
        return [(part, row - (ends[part - 1] if part else 0)) for part, row in zip(parts, rows)]

    def _merge_parts(self, plan: Sequence[int]) -> None:
        for first in plan:
            for layer in self._layers():
                layer.merge(first)

    def _consolidate(self) -> None:
        """Merge neighbouring parts where that adds little padding (`merges`); a model that attends
        without kv/slot_attention.py (not SDPA, or not prepared: SlotLayout.prepare) keeps one part."""
        rows, lengths = self.part_shapes()
        if len(rows) > 1:
            by_parts = attends_by_parts(self.model)
            self._merge_parts(merges(rows, lengths, self.merge_slack) if by_parts else [0] * (len(rows) - 1))

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the rows at `indices`, then drop leading columns that became padding in every row of
        a part. Rows keep their parts when `indices` visits the parts in order (as eviction and a
        beam search do); otherwise the parts are merged first."""
        located = self._locate(indices)
        runs = [(part, [local for _, local in group]) for part, group in itertools.groupby(located, lambda x: x[0])]
        if len({part for part, _ in runs}) != len(runs) or [p for p, _ in runs] != sorted(p for p, _ in runs):
            self._merge_parts([0] * (len(self.part_shapes()[0]) - 1))
            runs = [(0, list(indices))] if indices else []
        index = torch.tensor(list(indices), dtype=torch.long, device=self.mask.device)
        lengths = [self.lengths[i] for i in indices]  # the host's copy: nothing is read from the device
        mask = self.mask[index] if len(index) else self.mask[:0, :0]  # no rows: no columns either
        mask = mask[:, mask.shape[1] - max(lengths, default=0):]
        width, start = mask.shape[1], 0
        _, part_lengths = self.part_shapes()
        kept = {part for part, _ in runs}
        for layer in self._layers():
            layer.parts = [p for i, p in enumerate(layer.parts) if i in kept]
        for position, (part, local) in enumerate(runs):
            columns = min(part_lengths[part], width)
            # The leading columns of this part's window that are padding in each of its kept rows.
            padding = columns - max(lengths[start:start + len(local)])
            first = part_lengths[part] - columns + padding
            moved = [(target, source) for target, source in enumerate(local) if target != source]
            on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # layers may live on several GPUs
            for layer in self._layers():
                part = layer.parts[position]
                device = part.key_store.device
                if moved and device not in on_device:
                    on_device[device] = tuple(torch.tensor(side, dtype=torch.long, device=device) for side in zip(*moved))
                targets, sources = on_device[device] if moved else (None, None)
                part.select(len(local), targets, sources, first, moved)
            start += len(local)
        self.mask, self.lengths = mask, lengths
        self.next_pos, self.pending = self.next_pos[index], self.pending[index]
        self._consolidate()

    def eviction_order(self, survivors: Sequence[int]) -> list[int]:
        """`survivors` (ascending) in the order `keep` moves least: within each part, the places of the rows
        leaving are taken by the part's last survivors, so each leaving row costs one row's copy instead of
        moving every row after it (which took 7 ms an eviction at 32 streaming clients, 8 % of the engine)."""
        ends = list(itertools.accumulate(self.part_shapes()[0]))
        order, begin = [], 0
        for end in ends:
            mine = [row for row in survivors if begin <= row < end]
            places = range(begin, begin + len(mine))
            staying = {row for row in mine if row in places}
            moving = iter(row for row in mine if row not in places)
            order += [place if place in staying else next(moving) for place in places]
            begin = end
        return order

    def extend(self, other: "SlotKV") -> None:
        """Append `other`'s rows as its parts (no copy), then merge neighbours that fit together."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if theirs.is_initialized:  # a layer that reuses another's KV (Gemma 3n) keeps none
                if not mine.is_initialized:
                    mine.dtype, mine.device, mine.parts, mine.is_initialized = theirs.dtype, theirs.device, [], True
                mine.parts.extend(theirs.parts)
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.pending = torch.cat([self.pending, other.pending])
        self.lengths = self.lengths + other.lengths
        self._consolidate()

    def row_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """DynamicKV.row_kv, in the part holding `row` (whose columns are the mask's last ones)."""
        [(part, local)] = self._locate([row])
        out = []
        for layer in self.cache.layers:
            if not (layer.is_initialized and layer.parts):
                out.append(None)
                continue
            slot = layer.parts[part]
            first = slot.length - self.lengths[row]
            out.append((slot.keys[local, :, first + start:first + end], slot.values[local, :, first + start:first + end]))
        return out


class SlotLayout(DynamicLayout):
    """SlotKV's layout: DynamicLayout's declarations and attention, and a bound on memory to check
    at start-up (`slot_bytes`)."""

    name = "slots"

    def __init__(self, kv_class: type[SlotKV] = SlotKV):
        super().__init__(kv_class)

    def memory_bytes(self, model: Any, rows: int, columns: int) -> int:
        return slot_bytes(model, rows, columns)


SLOTS = SlotLayout()


def slot_bytes(model: Any, rows: int, columns: int) -> int:
    """The most the slot buffers of `rows` rows of `columns` tokens take (K and V, every layer)."""
    config = model.config.get_text_config(decoder=True)
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * layers * rows * heads * columns * head_dim * element
