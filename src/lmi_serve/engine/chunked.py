"""Chunked prefill: a prompt longer than the step's prefill budget is prefilled a chunk per step.

A prefill stalls every running row for as long as its forward takes, so the scheduler gives each
step a budget of prompt tokens (`max_rolling_batch_prefill_tokens`). A prompt over it used to go
whole (a 4,000-word prompt froze every stream for 26 s); now it takes at most the budget per step
and the running rows decode between its chunks. One prompt is chunked at a time; its first token is
sampled when its last chunk is in, and the row then joins the batch like any other.

A KV implementation supports this with `prefill_more(tokens)` on a one-row KVBatch (kv_dynamic.py,
and kv_slots.py through it); encoder-decoder rows and requests that want prompt logprobs are
prefilled whole, as before.
"""

from __future__ import annotations

from typing import Any

from .batch import Batch, Row
from .kv import KVBatch, KVFactory, Prefilled
from .prefix_cache import PrefixCache, resume_from_cache
from .types import GenerationRequest


def supports_chunks(factory: KVFactory) -> bool:
    """Whether the KV implementation behind `factory` can continue a prefill (`prefill_more`)."""
    return hasattr(getattr(factory, "__self__", None), "prefill_more")


def chunkable(request: GenerationRequest) -> bool:
    return not request.prompt_logprobs  # prompt logprobs come from one whole-prompt forward


class ChunkedPrefill:
    """One row's prompt, prefilled `advance(budget)` tokens at a time."""

    def __init__(self, row: Row, model: Any, factory: KVFactory, pad_id: int, device: Any,
                 prefixes: PrefixCache | None = None):
        """With `prefixes`, the first `advance` starts from the longest prefix of the prompt that the
        prefix cache holds (prefix_cache.py), so only the rest is prefilled."""
        self.row = row
        self._model, self._factory, self._pad_id, self._device = model, factory, pad_id, device
        self._prefixes = prefixes
        self._kv: KVBatch | None = None
        self.done = 0  # prompt tokens prefilled (or taken from the prefix cache) so far

    @property
    def remaining(self) -> int:
        return len(self.row.request.prompt_ids) - self.done

    def advance(self, budget: int) -> Batch | None:
        """Prefill up to `budget` (>= 1) more prompt tokens; once the prompt is all in, the row's
        Batch with the logits its first token is sampled from; before that, None."""
        prompt = self.row.request.prompt_ids
        if self._kv is None and self._prefixes is not None:
            self._kv, self.done = resume_from_cache(self._prefixes, self._factory, self._model, prompt, self._device)
        chunk = prompt[self.done:self.done + max(budget, 1)]
        if self._kv is None:
            out = self._factory(self._model, [chunk], pad_id=self._pad_id, device=self._device)
            self._kv, logits = out.kv, out.logits
        else:
            logits = self._kv.prefill_more(chunk)
        self.done += len(chunk)
        if self.remaining:
            return None
        return Batch.prefilled([self.row], Prefilled(self._kv, logits), self._device)
