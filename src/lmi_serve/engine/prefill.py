"""The prefill half of `Scheduler.step` (scheduler.py): the admitted joiners' prompts become rows
of the running batch, with their first tokens sampled and sent.

- a prompt whose start the prefix cache holds (kv/prefix_cache.py) is prefilled alone, from those
  blocks: only the rest of it runs;
- a prompt with images (a vision-language model) is prefilled whole, alone, and never from or into
  the prefix cache: its K/V depend on the pixels, which the cache's token-id keys do not show;
- the other joiners are prefilled in groups of similar length (`_groups`: padding is wasted
  compute, and prefill on a CPU is compute-bound, so a group only pays when it adds little padding);
  a group that fails is retried a row at a time, so only the request at fault fails;
- the chunked prompt (chunked.py) is continued by one chunk; its row joins after its last chunk.
With a step pace (pace.py), `paced` times steps 3-7 and tells it what they ran.
Each forward runs under `guarded_forward` (guarded.py), as the decode does.

With mixed steps (option.mixed_steps, kv/mixed.py: where the layout `mixes` the model and a batch is
running) there is no prefill forward: the joiners' prompts (each from its prefix-cache match, if
any) and the chunked prompt's next chunk go through the running rows' decode forward
(`mixed_forward`; the scheduler then samples the running rows, and `mixed_joined` the joiners), which
reads the weights once for all of them (rows of LoRA adapters too: the forward gets each token's
slot). A step keeps its separate forwards when a joiner's prompt cannot be chunked (images, prompt
logprobs). A mixed forward that raises leaves every batch as it was, and the step runs its parts
separately, so that a prompt at fault fails alone (the failed mixed forward counts as a failed step
too).

`Prefill` is an object the scheduler holds: it owns the chunked prompt (`chunking`, started by the
scheduler's admission) and hands the scheduler the batches of rows that joined, which the scheduler
merges into its running batch. It never sees the running batch except to time it (`paced`) and to
feed a mixed forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from lmi_serve.engine.batch import Batch, Row, make_row
from lmi_serve.engine.chunked import ChunkedPrefill, chunkable
from lmi_serve.engine.guarded import guarded_forward
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.prefix_cache import PrefixCache
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.pace import StepPace, StepWork, decode_context, prompt_work
from lmi_serve.engine.phases import DECODE, EVICT, PREFILL
from lmi_serve.engine.step_ops import StepOps
from lmi_serve.engine.types import GenerationRequest

log = logging.getLogger("lmi_serve.engine.scheduler")  # the scheduler's log, where these lines always were


class PrefillCounts(Protocol):
    """What the prefill counts in the scheduler's stats (scheduler.py `SchedulerStats`)."""

    prefills: int
    admitted: int
    failed_steps: int


@dataclass
class MixedForward:
    """A mixed forward that ran (`Prefill.mixed_forward`): each prompt's prefill, the K/V batch its
    chunk went to and the chunk's tokens, in the packed order; `last`: each one's last logits."""

    chunks: list[tuple[ChunkedPrefill, object, list[int]]]
    last: torch.Tensor


class Prefill:
    """The prefill half of the step (module docstring), held by the Scheduler."""

    def __init__(self, model, tokenizer, device, kv_layout: KVLayout, *, ops: StepOps, stats: PrefillCounts,
                 prefixes: PrefixCache | None = None, pace: StepPace | None = None, max_padding: float = 0.25,
                 mixed: bool = False):
        self.model, self.tokenizer, self.device, self.kv_layout = model, tokenizer, device, kv_layout
        self.ops, self.phases, self.stats = ops, ops.phases, stats
        self.prefixes = prefixes
        self.pace = pace  # learns from each step's work and time (`paced`); sizes the step's budget
        self.max_padding = max_padding
        self.mixed = mixed  # prompts ride in the decode forward where they can (`mixable`)
        self.chunking: ChunkedPrefill | None = None  # started by admission, dropped once its last chunk is in

    # -- what a prompt costs -------------------------------------------------------------------
    def uses_prefixes(self, request: GenerationRequest) -> bool:
        """The prefix cache serves this request's prompt: the cache is on, the prompt is chunkable
        (so it has no images: their K/V depend on pixels that the cache's token-id keys do not show)
        and the request is on the base model."""
        return self.prefixes is not None and chunkable(request) and request.adapter is None

    def cached_tokens(self, request: GenerationRequest) -> int:
        """How many of `request`'s prompt tokens the prefix cache would spare its prefill."""
        if not self.uses_prefixes(request):
            return 0
        return self.prefixes.cached_tokens(request.prompt_ids)

    def cost(self, request: GenerationRequest) -> int:
        """The prompt tokens `request`'s prefill runs (what the step's budget counts)."""
        return len(request.prompt_ids) - self.cached_tokens(request)

    @contextlib.contextmanager
    def paced(self, rows: list[Row], joiners: list[RequestHandle]) -> Iterator[None]:
        """Steps 3-7, timed for the step pace (pace.py) with the work they are about to do: the
        decode of the running `rows`, the joiners' prompts and the chunked prompt's next chunk."""
        if self.pace is None:
            yield
            return
        context = decode_context(rows)
        tokens, pairs = 0, 0.0
        for handle in joiners:
            cached = self.cached_tokens(handle.request)
            rest = len(handle.request.prompt_ids) - cached
            tokens, pairs = tokens + rest, pairs + prompt_work(cached, rest)
        chunking, done = self.chunking, self.chunking.done if self.chunking is not None else 0
        start = self.pace.clock()
        yield
        seconds = self.pace.clock() - start
        if chunking is not None:  # its chunk is known once it ran (the first may start from the prefix cache)
            start_at = max(done, chunking.cached)
            fed = chunking.done - start_at
            tokens, pairs = tokens + fed, pairs + prompt_work(start_at, fed)
        self.pace.observe(StepWork(len(rows), context, tokens, pairs), seconds)

    # -- the joiners ---------------------------------------------------------------------------
    def join(self, handles: list[RequestHandle]) -> list[Batch]:
        """Prefill the joiners: each prompt with a cached prefix alone (only its rest runs), the others
        in groups. The batches of the rows that joined, in the order they were prefilled."""
        joined, misses = [], []
        for handle in handles:
            if self.cached_tokens(handle.request):
                joined.append(self._prefill_rest(handle))
                continue
            if self.uses_prefixes(handle.request):
                self.prefixes.count(len(handle.request.prompt_ids), 0)
            misses.append(handle)
        for group in self.groups(misses):
            joined.append(self._prefill([make_row(h.request, self.tokenizer, owner=h, constraint=h.constraint,
                                                  watermark=h.watermark, adapter_slot=h.adapter_slot)
                                         for h in group]))
        return [batch for batch in joined if batch is not None]

    def groups(self, handles: list[RequestHandle]) -> list[list[RequestHandle]]:
        """Split joiners into prefill groups whose left padding stays under `max_padding`; a prompt
        with images is a group of its own (its pixels go with one prompt: kv/protocol.py item 7)."""
        groups: list[list[RequestHandle]] = []
        real = 0
        alone = [[h] for h in handles if h.request.images is not None]  # a prompt with images: its own forward
        for handle in sorted(handles, key=lambda h: len(h.request.prompt_ids)):
            if handle.request.images is not None:
                continue
            length = len(handle.request.prompt_ids)
            group = groups[-1] if groups else None
            if group and (len(group) + 1) * length <= (1 + self.max_padding) * (real + length):
                group.append(handle)
                real += length
            else:
                groups.append([handle])
                real = length
        return groups + alone

    def _prefill(self, rows: list[Row]) -> Batch | None:
        """One prefill forward of `rows`; if a group's fails, each row is retried alone."""
        group = len(rows) > 1
        failure = None if group else f"Prefill failed for request {rows[0].owner.id}"  # a group's rows retry alone
        with guarded_forward(rows, self.stats, failure) as forward:
            with self.ops.forward(PREFILL, [r.adapter_slot for r in rows]):
                batch = Batch.prefill(self.model, rows, self.tokenizer.pad_token_id, self.device, self.kv_layout)
            self._first_tokens(batch)
        if not forward.failed:
            return self._admitted(batch)
        if not group:
            return None
        log.warning("Prefill of %d requests failed (%s); retrying each alone", len(rows), forward.error)
        alone = [self._prefill([row]) for row in rows]
        return self.ops.merge([b for b in alone if b is not None])

    def _prefill_rest(self, handle: RequestHandle) -> Batch | None:
        """Prefill a prompt whose start the prefix cache holds: only the rest runs, in one forward."""
        prefill = self.start(handle)
        with guarded_forward([prefill.row], self.stats, f"Prefill failed for request {handle.id}") as forward:
            with self.ops.forward(PREFILL, [prefill.row.adapter_slot]):
                batch = prefill.finish()
            self._first_tokens(batch)
        return None if forward.failed else self._admitted(batch)

    # -- the chunked prompt --------------------------------------------------------------------
    def start(self, handle: RequestHandle) -> ChunkedPrefill:
        """A one-row prefill of `handle`'s prompt, which its first `advance` starts from the prefix
        cache's longest match, if any (admission makes one the chunked prompt: `chunking`)."""
        row = make_row(handle.request, self.tokenizer, owner=handle, constraint=handle.constraint,
                       watermark=handle.watermark, adapter_slot=handle.adapter_slot)
        prefixes = self.prefixes if self.uses_prefixes(handle.request) else None
        prefill = ChunkedPrefill(row, self.model, self.kv_layout, self.tokenizer.pad_token_id, self.device, prefixes)
        if self.pace is not None:
            prefill.crossover = self.pace.crossover  # measured on this machine: sizes its chunks
        return prefill

    def advance_chunk(self, budget: int) -> Batch | None:
        """The next chunk of the chunked prompt; after the last one, the batch of its row (to join)."""
        chunking = self.chunking
        batch = None
        with guarded_forward([chunking.row], self.stats,
                             f"Chunked prefill failed for request {chunking.row.owner.id}") as forward:
            with self.ops.forward(PREFILL, [chunking.row.adapter_slot]):
                batch = chunking.advance(budget)
            if batch is not None:
                self.chunking = None
                self._first_tokens(batch)
        if forward.failed:
            self.chunking = None
            return None
        return self._admitted(batch) if batch is not None else None

    # -- the mixed step ------------------------------------------------------------------------
    def mixable(self, batch: Batch | None, joiners: list[RequestHandle]) -> bool:
        """Whether this step's prompts can ride in the running `batch`'s decode forward (the module
        docstring)."""
        if not (self.mixed and batch and (joiners or self.chunking is not None)):
            return False
        return all(chunkable(handle.request) for handle in joiners)

    def mixed_forward(self, batch: Batch, joiners: list[RequestHandle], chunk_budget: int) -> MixedForward | None:
        """One forward: `batch`'s decode (its logits left to sample), the chunked prompt's next chunk
        (`chunk_budget`) and every joiner's whole prompt. None when it raised: every batch is as it
        was (kv/protocol.py item 11), and the step runs its parts separately."""
        prefills = [self.start(handle) for handle in joiners]
        chunks = ([(self.chunking, *self.chunking.next_chunk(chunk_budget))] if self.chunking is not None else [])
        chunks += [(prefill, *prefill.next_chunk(None)) for prefill in prefills]
        slots = [*batch.adapter_slots, *(slot for prefill, _, tokens in chunks for slot in
                                          [prefill.row.adapter_slot] * len(tokens))]  # each token's adapter
        with guarded_forward([], self.stats, None) as forward:  # a failure fails no row here: see above
            with self.ops.forward(DECODE, slots, packed=True):
                batch.logits, last = batch.kv.decode_with([(kv, tokens) for _, kv, tokens in chunks])
        if forward.failed:
            log.warning("A mixed step failed (%s); running its prefills and decode separately", forward.error)
            return None
        return MixedForward(chunks, last)

    def mixed_joined(self, mixed: MixedForward) -> Batch | None:
        """After a mixed forward: the rows whose prompts are all in sample their first tokens; their batch."""
        done = []
        for i, (prefill, _, tokens) in enumerate(mixed.chunks):
            joined = prefill.fed(len(tokens), mixed.last[i:i + 1])
            if joined is not None:
                done.append(joined)
                if prefill is self.chunking:
                    self.chunking = None
        if not done:
            return None
        logits = torch.cat([batch.logits for batch in done])  # `concatenate` joins rows, not pending logits
        joined = self.ops.merge(done)
        joined.logits = logits
        with guarded_forward(joined.rows, self.stats, "Sampling the first tokens failed") as forward:
            self._first_tokens(joined)
        return None if forward.failed else self._admitted(joined)

    # -- after a prefill -----------------------------------------------------------------------
    def _first_tokens(self, batch: Batch) -> None:
        """After a prefill: keep the prompts' blocks for later prompts, sample and send the first tokens."""
        self._remember(batch)
        self.ops.deliver(self.ops.emit(batch, self.ops.sample(batch)))

    def _remember(self, batch: Batch) -> None:
        if self.prefixes is None:
            return
        with self.phases.measure(PREFILL):
            for i, row in enumerate(batch.rows):
                if row.adapter_slot is not None or row.request.images is not None:
                    continue  # K/V of an adapter, or of images: not what these token ids alone give
                self.prefixes.store(row.request.prompt_ids, functools.partial(batch.kv.row_kv, i))

    def _admitted(self, batch: Batch) -> Batch | None:
        """Count a successful prefill and drop its rows that finished at their first token."""
        self.stats.prefills += 1
        self.stats.admitted += len(batch)
        with self.phases.measure(EVICT):
            batch.evict_finished()
        return batch if len(batch) else None
