"""Encoder-decoder rows (T5, BART and kin) behind the KV seam (kv/protocol.py).

A prefill runs the encoder once over the new rows' prompts (right-padded: the encoder's positions
start at 0 in every row) and one decoder forward over the decoder prompt, which fills both halves
of a transformers `EncoderDecoderCache`: the self-attention KV, which grows one column per step,
and the cross-attention KV, computed once from the encoder's output and reused by every step.
After that a row is a decoder row like a causal one: its self-attention KV is left-padded exactly
as kv/dynamic.py's, and its encoder output and cross-attention KV stay right-padded beside it
(`enc_mask` hides the padding), so rows that joined at different times, with prompts of different
lengths, decode in one forward.

Left padding shifts a row's decoder columns, so the decoder must be told each row's positions.
T5's relative attention bias depends only on distances between columns, which equal distances
between positions within a row. BART-style decoders look up absolute position embeddings from the
cache length, shared by every row; `RowPositions` makes that lookup read per-row positions. The
model types served, and how, are `DECODER_POSITIONS`; support.py refuses the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from lmi_serve.engine.kv.dynamic import join_left_padded, keep_rows
from lmi_serve.engine.kv.protocol import KVLayout, Prefilled, layer_bytes

# How each encoder-decoder family's decoder learns positions: "relative" (T5's bias depends on
# column distance only) or "embedding" (an absolute embedding lookup, fed per-row positions by
# RowPositions). tests/unit/engine/test_architectures.py checks each against `generate()`.
DECODER_POSITIONS = {
    "t5": "relative", "mt5": "relative", "umt5": "relative",
    "bart": "embedding", "mbart": "embedding", "marian": "embedding", "pegasus": "embedding",
}


def decoder_prompt(model: Any) -> tuple[int, ...]:
    """What a row's decoder starts from: the decoder start token, then the token the model's
    generation config forces first (`forced_bos_token_id`: BART's `<s>`, mBART's target language),
    which transformers' `generate()` would emit as the first new token."""
    generation = getattr(model, "generation_config", None)

    def setting(name: str) -> int | None:  # the generation config's, else the model config's
        value = getattr(generation, name, None)
        return value if value is not None else getattr(model.config, name, None)

    # Without a decoder start token (mBART), generate() starts from BOS; so does the engine.
    start = setting("decoder_start_token_id")
    if start is None:
        start = setting("bos_token_id")
    if start is None:
        raise ValueError(f"{type(model).__name__} has neither a decoder_start_token_id nor a bos_token_id")
    forced = setting("forced_bos_token_id")
    return (int(start),) if forced is None else (int(start), int(forced))


class RowPositions:
    """Makes a decoder's absolute position embedding (`decoder.embed_positions`, an nn.Embedding
    subclass that would count positions from the shared cache length) look up per-row positions
    while `rows` is set; otherwise it behaves exactly as before. Installed once per model."""

    def __init__(self, embedding: nn.Embedding):
        self.rows: torch.Tensor | None = None  # [rows, new tokens]: each row's positions
        original = embedding.forward
        offset = getattr(embedding, "offset", 0)  # BART-likes reserve the first two rows

        def forward(*args, **kwargs):
            if self.rows is None:
                return original(*args, **kwargs)
            return nn.Embedding.forward(embedding, self.rows + offset)

        embedding.forward = forward

    @classmethod
    def of(cls, model: Any) -> "RowPositions | None":
        """The model's RowPositions (installed on first use), or None where positions are relative."""
        if DECODER_POSITIONS.get(model.config.model_type) != "embedding":
            return None
        embedding = model.get_decoder().embed_positions
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"{type(model).__name__}'s decoder positions are not an embedding lookup")
        installed = getattr(embedding, "_lmi_row_positions", None)
        if installed is None:
            installed = cls(embedding)
            embedding._lmi_row_positions = installed
        return installed


def _right_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        mask[i, :len(prompt)] = 1
    return input_ids.to(device), mask.to(device)


class EncoderDecoderKV:
    """Row i of every tensor here is the batch's row i."""

    def __init__(self, model: Any, cache: EncoderDecoderCache, mask: torch.Tensor, encoded: torch.Tensor,
                 enc_mask: torch.Tensor, next_pos: torch.Tensor, pending: torch.Tensor):
        self.model = model
        self.cache = cache
        self.mask = mask  # [rows, decoder length]: self-attention columns, left-padded
        self.encoded = encoded  # [rows, prompt length, hidden]: the encoder's output, right-padded
        self.enc_mask = enc_mask  # [rows, prompt length]: 1 for real prompt tokens
        self.next_pos = next_pos  # [rows]: decoder position of the pending token
        self.pending = pending  # [rows]: the token the next decode feeds
        self.positions = RowPositions.of(model)

    @classmethod
    def prefill(cls, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        """The encoder over `prompts`, then the decoder over its prompt (the same
        for every row, so no padding and default positions)."""
        if model_inputs:
            raise ValueError("encoder-decoder rows take no images")
        if prompt_logits:
            raise ValueError("an encoder-decoder model's prompt is the encoder's input, which has no logprobs")
        input_ids, enc_mask = _right_pad(prompts, pad_id, device)
        start = decoder_prompt(model)
        decoder_ids = torch.tensor([start] * len(prompts), dtype=torch.long, device=device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.inference_mode():
            encoded = model.get_encoder()(input_ids=input_ids, attention_mask=enc_mask).last_hidden_state
            out = model(attention_mask=enc_mask, encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                        decoder_input_ids=decoder_ids, decoder_attention_mask=torch.ones_like(decoder_ids),
                        past_key_values=cache, use_cache=True)
        kv = cls(model, cache, torch.ones_like(decoder_ids), encoded, enc_mask,
                 torch.full((len(prompts),), len(start), dtype=torch.long, device=device), decoder_ids[:, -1])
        return Prefilled(kv, out.logits[:, -1, :], seen=[start] * len(prompts))

    def __len__(self) -> int:
        return self.mask.shape[0]

    def feed(self, tokens: torch.Tensor) -> None:
        self.pending = tokens

    def decode(self) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        if self.positions is not None:
            self.positions.rows = self.next_pos[:, None]
        try:
            with torch.inference_mode():
                out = self.model(attention_mask=self.enc_mask,
                                 encoder_outputs=BaseModelOutput(last_hidden_state=self.encoded),
                                 decoder_input_ids=self.pending[:, None], decoder_attention_mask=self.mask,
                                 past_key_values=self.cache, use_cache=True)
        finally:
            if self.positions is not None:
                self.positions.rows = None
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def held_bytes(self) -> int:
        """Bytes of K/V storage held, self- and cross-attention, and the encoder's output (kv/protocol.py item 6)."""
        return (layer_bytes(self.cache.self_attention_cache.layers) + layer_bytes(self.cache.cross_attention_cache.layers)
                + self.encoded.untyped_storage().nbytes())

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the rows at `indices`; drop decoder columns that became padding in every row (on the
        left) and prompt columns that did (on the right)."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.mask.device)
        self.mask = keep_rows(self.cache.self_attention_cache, self.mask, index)
        cross = self.cache.cross_attention_cache
        cross.batch_select_indices(index)
        self.encoded, self.enc_mask = self.encoded[index], self.enc_mask[index]
        used = self.enc_mask.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else self.enc_mask.shape[1]
        if width < self.enc_mask.shape[1]:
            for layer in cross.layers:
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
            self.encoded, self.enc_mask = self.encoded[:, :width], self.enc_mask[:, :width]
        self.next_pos, self.pending = self.next_pos[index], self.pending[index]

    def extend(self, other: "EncoderDecoderKV") -> None:
        """Append `other`'s rows: decoder columns left-padded, prompt columns right-padded."""
        self.mask = join_left_padded(self.cache.self_attention_cache, self.mask,
                                     other.cache.self_attention_cache, other.mask)
        width = max(self.enc_mask.shape[1], other.enc_mask.shape[1])

        def right(t: torch.Tensor, dim: int) -> torch.Tensor:
            pad = [0, 0] * (t.dim() - dim - 1) + [0, width - t.shape[dim]]
            return F.pad(t, pad)

        for mine, theirs in zip(self.cache.cross_attention_cache.layers, other.cache.cross_attention_cache.layers):
            mine.keys = torch.cat([right(mine.keys, 2), right(theirs.keys, 2)])
            mine.values = torch.cat([right(mine.values, 2), right(theirs.values, 2)])
        self.encoded = torch.cat([right(self.encoded, 1), right(other.encoded, 1)])
        self.enc_mask = torch.cat([right(self.enc_mask, 1), right(other.enc_mask, 1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.pending = torch.cat([self.pending, other.pending])


class EncoderDecoderLayout(KVLayout):
    """EncoderDecoderKV's layout. A prompt is the encoder's input, run in one forward, so no chunked
    prefill and no prefix reuse; the model attends as loaded (its decoder rows stay one tensor)."""

    name = "encoder-decoder"

    def prefill(self, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        return EncoderDecoderKV.prefill(model, prompts, pad_id=pad_id, device=device, prompt_logits=prompt_logits,
                                        model_inputs=model_inputs)


ENCODER_DECODER = EncoderDecoderLayout()
