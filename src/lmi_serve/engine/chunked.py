"""Chunked prefill: a prompt longer than the step's prefill budget is prefilled a chunk per step.

A prefill stalls every running row for as long as its forward takes, so the scheduler gives each
step a budget of prompt tokens (`max_rolling_batch_prefill_tokens`). A prompt over it used to go
whole (a 4,000-word prompt froze every stream for 26 s); now it takes at most the budget per step
and the running rows decode between its chunks. One prompt is chunked at a time; its first token is
sampled when its last chunk is in, and the row then joins the batch like any other.

A chunk's cost grows with the context it attends over: prompt tokens cost their linear layers
plus attention over everything before them, so at 1,500 tokens in, a 512-token chunk of SmolLM2
took 1.2 s where the first took 0.6 s (AVX-512 Xeon). The budget therefore counts a chunk's tokens
weighted by the context they attend over (`chunk_tokens`, `attention_crossover`): late chunks are
shorter, and every step's prefill costs about the same.

A KV layout that declares `supports_chunks` (kv/protocol.py) has `prefill_more(tokens)` on a
one-row KVBatch (kv/dynamic.py, kv/slots.py); encoder-decoder rows, requests that want prompt
logprobs and prompts with images are prefilled whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from lmi_serve.engine.batch import Batch, Row
from lmi_serve.engine.kv.prefix_cache import PrefixCache, resume_from_cache
from lmi_serve.engine.kv.protocol import KVBatch, KVLayout, Prefilled
from lmi_serve.engine.types import GenerationRequest


def chunkable(request: GenerationRequest) -> bool:
    # Prompt logprobs come from one whole-prompt forward. An image's features replace its placeholder
    # tokens in the one forward that runs the vision encoder: a chunk boundary inside them would split
    # the image, so a prompt with images goes whole (over the step's budget too: then it is the step's
    # only prefill, as any prompt that cannot be chunked; scheduler.py `_admit`).
    return not request.prompt_logprobs and request.images is None


def attention_crossover(model: Any) -> float:
    """The context length at which a prompt token's attention costs as much as its linear layers
    (multiply-adds per token and layer: linear ~ the projections' and MLP's weights; attention ~
    2 x context x the query width); inf when the config does not say (then tokens count alone)."""
    config = model.config.get_text_config(decoder=True)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not hidden or not heads:
        return math.inf
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    linear = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    return linear / (2 * heads * head_dim)


def chunk_tokens(budget: int, done: int, crossover: float) -> int:
    """The most tokens (>= 1) whose prefill after `done` tokens costs at most `budget` tokens' worth:
    n tokens cost n x (1 + (done + n / 2) / crossover), their average context counted against the
    crossover."""
    budget = max(budget, 1)
    if not math.isfinite(crossover):
        return budget
    a, b = 1 / (2 * crossover), 1 + done / crossover  # a n^2 + b n <= budget
    n = int((math.sqrt(b * b + 4 * a * budget) - b) / (2 * a))
    return max(1, min(n, budget))


class ChunkedPrefill:
    """One row's prompt, prefilled `advance(budget)` tokens at a time."""

    def __init__(self, row: Row, model: Any, layout: KVLayout, pad_id: int, device: Any,
                 prefixes: PrefixCache | None = None):
        """`layout` declares `supports_chunks` (and `supports_prefixes`, with `prefixes`); the scheduler
        checks. With `prefixes`, the first `advance` starts from the longest prefix of the prompt that
        the prefix cache holds (kv/prefix_cache.py), so only the rest is prefilled."""
        self.row = row
        self._model, self._layout, self._pad_id, self._device = model, layout, pad_id, device
        self._prefixes = prefixes
        self.crossover = attention_crossover(model)  # the scheduler's step pace may set a measured one
        self._kv: KVBatch | None = None
        self.done = 0  # prompt tokens prefilled (or taken from the prefix cache) so far
        self.cached = 0  # of them, those taken from the prefix cache

    @property
    def remaining(self) -> int:
        return len(self.row.request.prompt_ids) - self.done

    def cost(self, budget: int) -> int:
        """What of `budget` the next `advance(budget)` spends: all of it, or what the rest of the
        prompt costs with its attention counted, when that is less."""
        rest = self.remaining * (1 + (self.done + self.remaining / 2) / self.crossover)
        return min(budget, math.ceil(rest))

    def advance(self, budget: int) -> Batch | None:
        """Prefill more prompt tokens, as many as `budget` (>= 1) allows with their attention counted
        (`chunk_tokens`); once the prompt is all in, the row's Batch with the logits its first token
        is sampled from; before that, None."""
        self._resume()
        return self._prefill(chunk_tokens(budget, self.done, self.crossover))

    def _resume(self) -> None:
        """Before the first chunk: start from the prefix cache's longest match, if any."""
        if self._kv is None and self._prefixes is not None:
            self._kv, self.done = resume_from_cache(self._prefixes, self._layout, self._model,
                                                    self.row.request.prompt_ids, self._device)
            self.cached = self.done

    def next_chunk(self, budget: int | None) -> tuple[KVBatch, Sequence[int]]:
        """For a mixed step (kv/mixed.py): the one-row batch the next chunk continues (from the prefix
        cache's longest match, or holding nothing) and the chunk's tokens, as many as `budget` allows
        (`advance`'s rule) or, with None, the rest of the prompt. `fed` then accounts them."""
        self._resume()
        if self._kv is None:
            self._kv = self._layout.empty(self._model, self._device)
        tokens = self.remaining if budget is None else chunk_tokens(budget, self.done, self.crossover)
        return self._kv, self.row.request.prompt_ids[self.done:self.done + tokens]

    def fed(self, tokens: int, logits: torch.Tensor) -> Batch | None:
        """After a mixed forward cached `tokens` more of the prompt: the row's Batch, with `logits`
        ([1, vocab], its last position's) to sample its first token from, once the prompt is all in."""
        self.done += tokens
        if self.remaining:
            self._store_so_far()
            return None
        return Batch.prefilled([self.row], Prefilled(self._kv, logits), self._device)

    def _store_so_far(self) -> None:
        """Between chunks: give the prefix cache the prompt's blocks prefilled so far. The scheduler stores
        the whole prompt's once it is in; stored here chunk by chunk, a long prompt's copies (~50 ms for
        2,000 tokens of SmolLM2 on a 2-core EPYC) are spread over its steps instead of lengthening its last."""
        if self._prefixes is not None:
            self._prefixes.store(self.row.request.prompt_ids[:self.done], functools.partial(self._kv.row_kv, 0))

    def finish(self) -> Batch:
        """Prefill the rest of the prompt in one forward (a prefix-cache hit's rest, scheduler.py)."""
        self._resume()
        return self._prefill(self.remaining)

    def _prefill(self, tokens: int) -> Batch | None:
        chunk = self.row.request.prompt_ids[self.done:self.done + tokens]
        if self._kv is None:
            out = self._layout.prefill(self._model, [chunk], pad_id=self._pad_id, device=self._device)
            self._kv, logits = out.kv, out.logits
        else:
            logits = self._kv.prefill_more(chunk)
        self.done += len(chunk)
        if self.remaining:
            self._store_so_far()
            return None
        return Batch.prefilled([self.row], Prefilled(self._kv, logits), self._device)
