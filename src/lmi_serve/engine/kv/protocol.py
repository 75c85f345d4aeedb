"""The KV seam: what the rest of the engine asks of the model-facing half of a batch.

A `KVBatch` owns everything a forward needs (the model, its KV cache and whatever bookkeeping the
layout wants: masks, positions, block tables) plus each row's pending token, the one the next
`decode()` feeds. Row i of a KVBatch is row i of the `Batch` that holds it. Python state (`Row`) and
sampling state (`SamplingHistory`) live elsewhere and never look inside.

A `KVLayout` is one way of keeping rows' K/V. It builds new KV batches (`prefill`) and declares what
else it offers, so its users ask it instead of probing the batches it makes:
- kv/dynamic.py `DYNAMIC`: transformers' `DynamicCache`, left-padded, concatenated every step;
- kv/slots.py `SLOTS` (the default, `config.DEFAULT_KV_CACHE`): the same layout in preallocated
  buffers written in place, kept in parts of rows of similar length (kv/slot_attention.py);
- kv/encdec.py `ENCODER_DECODER`: encoder-decoder rows (T5, BART), whatever `option.kv_cache` says;
- kv/replicate.py `Replicator`: any of those, every operation replayed on the tensor-parallel ranks.
kv/select.py picks one for a model. The scheduler and the batch receive the layout, so a paged cache
is a new layout, not a change to either.

Contract, for every layout and the KV batches it makes:
1. `layout.prefill(model, prompts, ...)` runs one forward over the prompts and returns the new
   KVBatch with the logits of each row's last prompt position (and, when asked, every prompt position);
2. `feed(tokens)` sets each row's pending token; `decode()` runs one forward feeding them and
   returns the logits of that position, one row each;
3. `keep(indices)` and `extend(other)` change the set of rows without changing any row's logits:
   a row's logits depend only on its own tokens, never on its neighbours or on the batch's history
   of joins and leaves (tests/unit/engine/test_kv.py holds every implementation to this). An index
   may repeat in `keep`: that row is copied, and each copy goes on as its own row (beam search).
4. Where `layout.supports_chunks`: `prefill_more(tokens)` on a one-row batch continues its prefill
   with the next chunk of its prompt and returns that chunk's last logits (chunked.py; without it a
   prompt goes whole).
5. Where `layout.supports_prefixes` (prefix caching, kv/prefix_cache.py): `row_kv(row, start, end)`
   gives a row's K/V of token positions [start, end) per layer, and `layout.resume(model, prefix,
   device=)` makes a one-row batch holding such K/V, which `prefill_more` continues as if it had
   prefilled them.
6. Optionally, `held_bytes()`: the bytes of K/V storage the batch holds now (padding and room to
   grow included), read from tensor sizes only (no device sync); the `kv_cache_bytes` metric.
7. `layout.prefill(..., model_inputs=)`, passed only for a prompt with images (a vision-language
   model's, as `ImageInputs.named()`): extra keyword tensors for that one forward, over exactly one prompt (a
   batch of one; prefill.py prefills an image row alone). Decoder-only layouts pass them to the
   forward (floating tensors in the model's dtype); the others refuse them.
8. `layout.prepare(model)` readies the model for the layout (the attention function it needs) and
   runs before the model's first forward through it; it is idempotent.
9. Optionally, `eviction_order(survivors)`: the same rows as `survivors` (ascending), in the order whose
   `keep` copies least (a slot cache fills a leaving row's place with its part's last row). A row's
   place carries no meaning, so the engine keeps finished rows' survivors in it (`eviction_order` below).
10. Where `layout.supports_speculation` (n-gram speculation, engine/speculation.py): `verify(drafts)` on a
   one-row batch feeds its pending token and then `drafts` in one forward, caching all, and returns the
   logits of each position fed ([1 + len(drafts), vocab]); `discard(n)` drops the last n cached tokens
   (the drafts the engine did not choose), after which the row goes on as if they had never been fed.
11. Where `layout.mixes(model)` (one forward per step, kv/mixed.py): `layout.empty(model, device)` makes a
   one-row batch holding nothing, and `decode_with(chunks)` runs `decode()` and, for each (one-row batch,
   tokens) of `chunks`, its `prefill_more(tokens)`, all in one forward: the rows' logits [rows, vocab] and
   each chunk's last position's [chunks, vocab], each as the separate calls would give them within float
   rounding. The chunks' batches then go on as after `prefill_more`. If the forward raises, every batch is
   left as it was before the call (the engine then runs the parts separately, so a prompt at fault fails alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class KVBatch(Protocol):
    def __len__(self) -> int:
        """The number of rows."""

    def feed(self, tokens: torch.Tensor) -> None:
        """Set each row's pending token: `tokens` is [rows] long, on the batch's device."""

    def decode(self) -> torch.Tensor:
        """One forward feeding every row its pending token, which is then cached: [rows, vocab] logits."""

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the rows at `indices`, in that order (an empty list leaves an empty batch); an
        index may repeat, making copies of that row (beam search, beams/rows.py)."""

    def extend(self, other: "KVBatch") -> None:
        """Append `other`'s rows after this batch's; `other` comes from the same factory and is spent."""


def held_bytes(kv: "KVBatch | None") -> int:
    """`kv.held_bytes()` (contract item 6); 0 for no batch or an implementation without it."""
    measure = getattr(kv, "held_bytes", None)
    return measure() if measure is not None else 0


def eviction_order(kv: "KVBatch", survivors: Sequence[int]) -> list[int]:
    """`kv.eviction_order(survivors)` (contract item 9); `survivors` as they are for an implementation without it."""
    order = getattr(kv, "eviction_order", None)
    return list(survivors) if order is None else order(survivors)


def forward_inputs(model: Any, model_inputs: Mapping[str, Any] | None, rows: int, device: torch.device
                   ) -> dict[str, Any]:
    """`model_inputs` (contract item 7) ready for the forward: on `device`, floating tensors in the
    model's dtype (a processor makes fp32 pixels; the vision tower may be fp16, and not every family
    casts its input itself: Llava's and Idefics3's do). Only one row carries them:
    its images' features replace that row's placeholder tokens, which a batch could not line up."""
    if not model_inputs:
        return {}
    if rows != 1:
        raise ValueError(f"images are prefilled one prompt at a time, not {rows}")
    dtype = getattr(model, "dtype", None)
    return {name: value.to(device, dtype=dtype) if value.is_floating_point() and dtype is not None
            else value.to(device) for name, value in model_inputs.items()}


def layer_bytes(layers) -> int:
    """Bytes of the storage behind transformers cache layers' `keys` and `values` (a view counts
    the whole storage it looks into: that is what stays allocated)."""
    return sum(tensor.untyped_storage().nbytes() for layer in layers if layer.is_initialized
               for tensor in (layer.keys, layer.values))


@dataclass
class Prefilled:
    """What a prefill returns: the new rows' KV batch and the logits to sample their first tokens from."""

    kv: KVBatch
    logits: torch.Tensor  # [rows, vocab]: each row's last prompt position
    prompt_logits: list[torch.Tensor] | None = None  # per row [len(prompt), vocab], when asked for
    # Per row, the tokens the model has already seen on the side it generates from, which the
    # repetition penalty counts: None means the prompts (a decoder-only model); an encoder-decoder
    # model's decoder has seen only its decoder prompt.
    seen: list[Sequence[int]] | None = None


class KVLayout:
    """One way of keeping rows' K/V (the contract above): what it supports, declared, and the
    prefill that starts its batches. The defaults declare nothing optional."""

    name = "kv"
    supports_chunks = False  # its batches have `prefill_more` (contract item 4)
    supports_prefixes = False  # `resume` here and `row_kv` on its batches (contract item 5)
    supports_speculation = False  # `verify` and `discard` on its one-row batches (contract item 10)

    def prefill(self, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        """One forward over `prompts` (token ids, at least one each) into a new KVBatch whose rows are
        the prompts in order; the pending tokens are unset until the first `feed`. `model_inputs`:
        contract item 7."""
        raise NotImplementedError

    def resume(self, model: Any, prefix: Sequence[tuple[torch.Tensor, torch.Tensor] | None], *,
               device: torch.device) -> KVBatch:
        """A one-row batch holding `prefix` (per layer K and V, [1, kv heads, tokens, head dim], or None
        for a layer that keeps none); only where `supports_prefixes`."""
        raise NotImplementedError(f"the {self.name} KV layout cannot start a row from a cached prefix")

    def prepare(self, model: Any) -> None:
        """Ready `model` for this layout, before its first forward through it (idempotent)."""

    def mixes(self, model: Any) -> bool:
        """Whether this layout's batches of `model` run prompt chunks in their decode forward (contract item 11)."""
        return False

    def empty(self, model: Any, device: torch.device) -> KVBatch:
        """A one-row batch holding no tokens, which `decode_with` fills; only where `mixes(model)`."""
        raise NotImplementedError(f"the {self.name} KV layout cannot run prompt chunks in a decode forward")

    def memory_bytes(self, model: Any, rows: int, columns: int) -> int | None:
        """The most this layout's K/V of `rows` rows of `columns` tokens can take, where it has a
        bound to check at start-up; None where it grows as rows do and checks nothing."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
