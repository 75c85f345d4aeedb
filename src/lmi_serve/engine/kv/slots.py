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
new buffers are left uninitialised (kv/slot_part.py `new_buffer`): zero-filling every grown buffer took 6 % of the
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
from lmi_serve.engine.kv.slot_attention import ATTENTION, Parts, attends_by_parts, decode_attention, special_kwargs
from lmi_serve.engine.kv.slot_part import SlotPart
from lmi_serve.kernels.attention import decode_kernel_applies
from lmi_serve.kernels.cpu import decode_kernel

# Two neighbouring parts merge when that adds at most this many padded (row, column) cells, about
# what attending per part costs in calls (measured: a cell ~4 us a step over 30 layers, a part's
# extra calls ~1 ms); and never more than MAX_PARTS parts: the pair that adds least padding merges.
MERGE_SLACK = 256
MAX_PARTS = 6


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

    def decode_attend(self, module: torch.nn.Module, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      kwargs: Mapping[str, Any]) -> torch.Tensor | None:
        """A decode step's layer: its K/V column written and attended in kernels/cpu/decode_kernel.py, without
        transformers' `update` and attention interface in between (kernels/layers/lean_layers.py asks; ~15 calls a
        layer fewer). The same write and the same kernel call as that way, so the same bits; returns the
        attention's output [rows, 1, query heads, dim], or None, having written nothing, where this does not
        apply (the caller then updates and attends as usual)."""
        if layer_idx >= len(self.layers) or self.offloading or query.shape[2] != 1 or special_kwargs(kwargs):
            return None
        layer = self.layers[layer_idx]
        config = getattr(module, "config", None)
        if (not layer.is_initialized or len(layer.parts) != 1 or not decode_kernel_applies(module)
                or getattr(config, "_attn_implementation", None) != ATTENTION):
            return None
        part = layer.parts[0]
        if (key.shape[0] != part.rows or key.shape[2] != 1 or key.dtype != part.key_store.dtype or not key.is_cpu
                or not value.is_cpu or not decode_kernel.eligible(query, key, value, None)
                or (mask is not None and not decode_kernel.eligible_mask(mask, query.shape[0], part.length + 1))):
            return None
        keys, values = part.write_column(key, value)
        out = decode_kernel.attend(query, keys, values, mask, scale)
        return out if out is not None else decode_attention(module, query, keys, values, mask, scaling=scale)[0]


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
