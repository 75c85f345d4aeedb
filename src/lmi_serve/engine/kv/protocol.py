"""The KV seam: what the rest of the engine asks of the model-facing half of a batch.

A `KVBatch` owns everything a forward needs (the model, its KV cache and whatever bookkeeping the
layout wants: masks, positions, block tables) plus each row's pending token, the one the next
`decode()` feeds. Row i of a KVBatch is row i of the `Batch` that holds it. Python state (`Row`) and
sampling state (`SamplingHistory`) live elsewhere and never look inside.

A KV implementation is one module with a factory (`KVFactory`): `kv/dynamic.py` is today's
left-padded transformers `DynamicCache`, `kv/encdec.py` the encoder-decoder rows (T5, BART), and
`kv/select.py` picks one for a model. The scheduler receives the factory, so a slot-based or paged
cache is a new file, not a change to the scheduler or the batch.

Contract, for every implementation:
1. `factory(model, prompts, ...)` runs one forward over the prompts and returns the new KVBatch
   with the logits of each row's last prompt position (and, when asked, every prompt position);
2. `feed(tokens)` sets each row's pending token; `decode()` runs one forward feeding them and
   returns the logits of that position, one row each;
3. `keep(indices)` and `extend(other)` change the set of rows without changing any row's logits:
   a row's logits depend only on its own tokens, never on its neighbours or on the batch's history
   of joins and leaves (tests/unit/engine/test_kv.py holds every implementation to this). An index
   may repeat in `keep`: that row is copied, and each copy goes on as its own row (beam search).
4. Optionally, `prefill_more(tokens)` on a one-row batch continues its prefill with the next chunk of
   its prompt and returns that chunk's last logits (chunked.py uses it; without it a prompt goes whole).
5. Optionally, for prefix caching (kv/prefix_cache.py): `row_kv(row, start, end)` gives a row's K/V of
   token positions [start, end) per layer, and the class method `resume(model, prefix, device=)` makes
   a one-row batch holding such K/V, which `prefill_more` continues as if it had prefilled them.
6. Optionally, `held_bytes()`: the bytes of K/V storage the batch holds now (padding and room to
   grow included), read from tensor sizes only (no device sync); the `kv_cache_bytes` metric.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class KVFactory(Protocol):
    def __call__(self, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                 prompt_logits: bool = False) -> Prefilled:
        """One forward over `prompts` (token ids, at least one each) into a new KVBatch whose rows are
        the prompts in order; the pending tokens are unset until the first `feed`."""
