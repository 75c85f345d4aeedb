"""One forward per step: the running rows' decode and prompt chunks packed into one sequence.

A joiner's prefill used to be a forward of its own, which read every weight again and stalled the
running rows while it ran. Here the decode rows' pending tokens and one or more prompt chunks (each
the next tokens of a one-row batch: a joiner from nothing, a chunked prompt, a prefix-cache hit's
rest) go through the model as one packed sequence `[1, rows + chunk tokens]`: the Linear layers,
norms and MLP see them as one matrix (one read of the weights), and only attention tells them apart.

How the model is made to do that without knowing: the forward gets a `PackedCache` as its cache.
Each layer's `update` splits the new K/V by position: the first `rows` columns are the decode rows'
(written into the running batch's cache as a decode step would write them, one per row), the rest
each chunk's (written into its own row's cache). It returns `Packed` keys and values that carry
both sides and their masks; kv/slot_attention.py's attention sees `Packed` and attends each side
against its own cache (the decode rows as a decode step does; a chunk causally over its row's
cached tokens and itself), then puts the outputs back in packed order. Rotary embeddings read the
per-token position ids; the model is given a ready 4D mask, so transformers builds none.

Only models whose forward does nothing else with the batch dimension or the mask qualify (`mixes`):
decoder-only families of full-attention layers, attending through kv/slot_attention.py, of the
model types the architecture matrix (tests/unit/engine/test_architectures.py) checks against
`generate()`. Windowed layers (their masks), ALiBi (read from the mask), vision prompts and
learned positions read from the mask keep their separate forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmi_serve.engine.kv.slot_attention import Packed, attends_by_parts
from lmi_serve.engine.layer_kinds import layer_types

# Model types whose decoder forward, given position ids and a 4D mask, uses neither for anything but
# rotary positions and attention (checked: tests/unit/engine/test_architectures.py, every KV layout).
MIXED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "phi", "gpt_neox"})


def mixes(model: Any) -> bool:
    """Whether `model` can run packed forwards (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not attends_by_parts(model):
        return False
    if config.model_type not in MIXED_MODEL_TYPES:
        return False
    return set(layer_types(config)) == {"full_attention"}


@dataclass
class PackPlan:
    """Where each side's tokens are in the packed sequence, and their masks ([rows or 1, 1, queries,
    columns] bool, True where a query attends; None: every column, or causal for a chunk from nothing)."""

    rows: int
    spans: list[tuple[int, int]]  # each chunk's [start, end) in the packed sequence
    decode_mask: torch.Tensor | None
    chunk_masks: list[torch.Tensor | None]


class PackedCache:
    """The cache a packed forward is given: per layer it writes the decode rows' column into
    `decode` (a transformers cache, one row each) and each chunk's columns into its own cache, and
    returns `Packed` keys and values for the attention."""

    def __init__(self, decode: Any, chunks: Sequence[Any], plan: PackPlan):
        self.decode, self.chunks, self.plan = decode, list(chunks), plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows = self.plan.rows
        # [1, kv heads, rows, dim] -> [rows, kv heads, 1, dim]: one new column per decode row
        decode_keys = key_states[0, :, :rows].transpose(0, 1).unsqueeze(2)
        decode_values = value_states[0, :, :rows].transpose(0, 1).unsqueeze(2)
        keys, values = [], []
        if rows:
            k, v = self.decode.update(decode_keys, decode_values, layer_idx)
            keys.append(k)
            values.append(v)
        for cache, (start, end) in zip(self.chunks, self.plan.spans):
            k, v = cache.update(key_states[:, :, start:end], value_states[:, :, start:end], layer_idx)
            keys.append(k)
            values.append(v)
        return Packed(keys, self.plan), Packed(values, self.plan)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # only read when no position ids are given, and a packed forward always gives them


def restorer(cache: Any) -> Callable[[], None]:
    """A function that puts `cache` (a transformers cache: DynamicCache, SlotCache) back as it is now,
    after a forward that raised part-way: layers it added go, and each layer's columns added since are
    cropped (contract item 11: a failed `decode_with` leaves every batch as it was)."""
    count = len(cache.layers)
    lengths = [layer.get_seq_length() if layer.is_initialized else None for layer in cache.layers]

    def restore() -> None:
        del cache.layers[count:]
        for index, (layer, before) in enumerate(zip(cache.layers, lengths)):
            if before is None:
                if layer.is_initialized:
                    cache.layers[index] = type(layer)()
            elif layer.get_seq_length() > before:
                layer.crop(before - layer.get_seq_length())
    return restore


def chunk_mask(cached: int, tokens: int, device: torch.device) -> torch.Tensor | None:
    """A chunk's causal mask over its row's `cached` tokens and itself: query i sees columns
    [0, cached + i]; None (SDPA's own causal mask) when nothing is cached."""
    if not cached:
        return None
    allowed = torch.ones((tokens, cached + tokens), dtype=torch.bool, device=device).tril(cached)
    return allowed[None, None]


def pack_plan(rows: int, decode_mask: torch.Tensor | None, chunks: Sequence[tuple[int, int]],
              device: torch.device) -> PackPlan:
    """The plan of a packed forward: `rows` decode rows first, then each chunk given as (tokens
    cached before it, its tokens)."""
    spans, start = [], rows
    for _, tokens in chunks:
        spans.append((start, start + tokens))
        start += tokens
    return PackPlan(rows, spans, decode_mask, [chunk_mask(cached, tokens, device) for cached, tokens in chunks])


def packed_forward(model: Any, decode_cache: Any, pending: torch.Tensor, decode_positions: torch.Tensor,
                   decode_mask: torch.Tensor | None, chunks: Sequence[tuple[Any, Sequence[int], int]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over the decode rows (`pending` tokens at `decode_positions`, `decode_mask` over
    their cache) and `chunks` (each: the one-row cache it continues, its tokens, the tokens cached
    before them). Returns the decode rows' logits [rows, vocab] and each chunk's last position's
    [chunks, vocab]."""
    device = pending.device
    ids = [pending] + [torch.tensor(list(tokens), dtype=torch.long, device=device) for _, tokens, _ in chunks]
    positions = [decode_positions] + [torch.arange(cached, cached + len(tokens), device=device)
                                      for _, tokens, cached in chunks]
    plan = pack_plan(len(pending), decode_mask, [(cached, len(tokens)) for _, tokens, cached in chunks], device)
    cache = PackedCache(decode_cache, [c for c, _, _ in chunks], plan)
    keep = torch.tensor(list(range(plan.rows)) + [end - 1 for _, end in plan.spans], device=device)
    # A 4D mask is taken as ready (transformers builds none from it); the attention reads `plan`'s.
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    with torch.inference_mode():
        out = model(input_ids=torch.cat(ids)[None], position_ids=torch.cat(positions)[None],
                    attention_mask=placeholder, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    logits = out.logits[0]
    return logits[:plan.rows], logits[plan.rows:]
