"""The rolling batch: a bounded waiting queue and the step loop that owns the model.

Order of operations in `Scheduler.step`:
1. drop cancelled requests and beam searches (waiting or running), fail waiting requests past
   their deadline, and end those past their generation deadline still waiting or prefilling in chunks
   (a running row ends at its next token: batch.py `Row.advance`); start waiting beam searches whose
   beams fit in the free rows (beams/jobs.py: the first one waiting holds the free rows until it fits);
2. admit waiting requests (first come, first served) while there are free rows and their prompt
   tokens fit the per-step prefill budget (less the prompts of beam searches starting this step):
   a prefill stalls every running row, so the budget bounds the longest gap between two tokens of
   a stream. With a step pace (pace.py) the budget is what the running rows' decode leaves of the
   step's seconds at the costs measured on the last steps, within the token budget. A prompt over
   what is left of it is
   prefilled a chunk per step (chunked.py; one at a time), or, where it cannot be chunked, whole
   as the step's only prefill. A request of a LoRA adapter also needs its adapter's slot
   (adapters.py): when every slot is held by running rows of other adapters, it waits at the head.
   With a K/V budget (`kv_tokens`, kv/budget.py: on a GPU, from option.gpu_memory_utilization) a
   request also needs room for the tokens it may reach (prompt + max_new_tokens, capped at the
   context) beside those the running rows reserve; else it waits at the head until rows leave (a
   request that could not fit even alone is refused by `add`);
3. continue the chunked prompt (its row joins once its last chunk is in), then prefill the joiners:
   a prompt the prefix cache starts (kv/prefix_cache.py) alone, the others in groups of similar
   length; store the prompts' blocks and sample the first tokens (prefill.py, every detail);
4. merge them into the running batch;
5. one decode forward for every running row, then sample; with n-gram speculation (speculation.py) a
   batch of one row instead verifies its drafts in one forward and takes the tokens that match
   (decode.py); with a running batch and mixed steps, steps 3-7 are one forward (`_mixed_step`: the
   prompts' tokens packed with the running rows' pending ones, kv/mixed.py);
6. emit each row's event (stop checks and detokenizing happen in the same loop);
7. evict finished rows at once (the KV batch frees their cache: `KVBatch.keep`);
8. advance every running beam search one token (beams/rows.py: one forward of its k beams in a KV
   batch of its own); one that raises fails alone.
`Scheduler.phases` times these (phases.py): admit (steps 1-2), prefill, decode (and step 8), sample, emit,
deliver, evict.
The scheduler holds its two halves: a `Prefill` (steps 3-4, prefill.py), which hands back the batches
of the rows that joined for `_add` to merge, and a `Decode` (steps 5-6, decode.py). Every forward is
timed and gets its rows' LoRA slots in one place (step_ops.py `StepOps.forward`), and runs under one
rule (guarded.py): an exception in a prefill fails only the joiners it concerns (each is retried alone
first); one in a decode fails the running rows. Either way the loop goes on with new requests.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from lmi_serve.engine.adapters import Adapters
from lmi_serve.engine.batch import Batch, Row
from lmi_serve.engine.beams.jobs import BeamJobs, settle
from lmi_serve.engine.beams.rows import BeamSearch
from lmi_serve.engine.chunked import ChunkedPrefill, attention_crossover, chunkable
from lmi_serve.engine.decode import Decode
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.budget import request_tokens
from lmi_serve.engine.kv.prefix_cache import PrefixCache, PrefixStats
from lmi_serve.engine.kv.protocol import KVLayout, held_bytes
from lmi_serve.engine.kv.select import layout_for
from lmi_serve.engine.observer import EngineObserver, StepReport
from lmi_serve.engine.pace import StepPace, decode_context
from lmi_serve.engine.phases import ADMIT, DECODE, EVICT, for_device
from lmi_serve.engine.prefill import Prefill
from lmi_serve.engine.speculation import NgramSpeculation, SpeculationStats
from lmi_serve.engine.step_ops import StepOps
from lmi_serve.engine.types import TokenEvent
from lmi_serve.errors import GenerationFailed, InvalidRequest, Overloaded, ServingError, Timeout
from lmi_serve.model.lora import AdapterError


@dataclass
class SchedulerStats:
    steps: int = 0
    prefills: int = 0
    admitted: int = 0
    largest_batch: int = 0
    failed_steps: int = 0
    mixed_steps: int = 0  # steps whose prompts rode in the decode forward (`_mixed_step`)
    kv_cache_bytes: int = 0  # K/V storage the batch held at the last step's end (kv/protocol.py held_bytes)


class Scheduler:
    """The rolling batch (see the module docstring); it holds its step's halves, `self.prefill`
    (prefill.py) and `self.decode` (decode.py)."""

    def __init__(self, model, tokenizer, device, *, max_batch_size: int, max_queue: int,
                 max_prefill_tokens: int = 512, max_padding: float = 0.25,
                 kv_layout: KVLayout | None = None, prefix_cache: PrefixCache | None = None,
                 adapters: Adapters | None = None, kv_tokens: int | None = None,
                 max_model_len: int | None = None, speculation: NgramSpeculation | None = None,
                 mixed_steps: bool = True, step_seconds: float | None = None):
        """`kv_layout` prefills new rows into KV batches (kv/protocol.py) and says whether a prompt can
        be chunked; None picks the model's default (kv/select.py). `prefix_cache` (kv/prefix_cache.py)
        lets prompts reuse the K/V of a prefix prefilled before; the layout must declare
        `supports_prefixes`. `adapters` (adapters.py) gives an admitted request of a LoRA adapter its
        slot; rows of adapters do not use the prefix cache (its K/V are the base model's). `kv_tokens`:
        the K/V tokens running rows may reserve together (kv/budget.py; None: no bound), each row
        what its request may reach, capped at `max_model_len`. `speculation` (speculation.py): drafts for
        a batch of one row; the layout must declare `supports_speculation`. `mixed_steps`: joiners' prompts
        go through the running rows' decode forward where the layout `mixes` the model (`_mixed_step`).
        `step_seconds`: the seconds a step that prefills may take (pace.py: its prompt tokens are paced to
        them, within `max_prefill_tokens`); None: tokens alone."""
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.kv_layout = kv_layout or layout_for(model)
        # Idempotent: engine/build.py prepared it before the warm-up; an engine built directly (tests,
        # benchmarks) runs its model as the server would only if it is prepared here too.
        self.kv_layout.prepare(model)
        self.chunks = self.kv_layout.supports_chunks
        self.mixed = mixed_steps and self.chunks and self.kv_layout.mixes(model)
        if prefix_cache is not None and not self.kv_layout.supports_prefixes:
            raise ValueError("this model's KV cache cannot start a row from a cached prefix")
        self.prefixes = prefix_cache
        if speculation is not None and not self.kv_layout.supports_speculation:
            raise ValueError("this model's KV cache cannot verify draft tokens")
        self.speculation = speculation
        self.adapters = adapters
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_tokens = kv_tokens
        self.max_model_len = max_model_len
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.beams = BeamJobs()
        self.batch: Batch | None = None
        self.work = threading.Condition()
        self.stats = SchedulerStats()
        self.phases = for_device(device)  # synchronizes at phase boundaries on CUDA (phases.py)
        self.ops = StepOps(model, self.phases)
        self.decode = Decode(self.ops, self.stats, speculation)
        pace = StepPace(step_seconds, prior_crossover=attention_crossover(model)) if step_seconds else None
        self.prefill = Prefill(model, tokenizer, device, self.kv_layout, ops=self.ops, stats=self.stats,
                               prefixes=prefix_cache, pace=pace, max_padding=max_padding, mixed=self.mixed)
        self.observer: EngineObserver | None = None  # told each step's batch size and queue (observer.py)

    # The prefill's, read and set here too: the long prompt prefilled a chunk per step (admission starts
    # it), and the step pace (pace.py), which sizes the step's budget and learns from what the prefill runs.
    chunking = property(lambda self: self.prefill.chunking,
                        lambda self, chunking: setattr(self.prefill, "chunking", chunking))
    pace = property(lambda self: self.prefill.pace, lambda self, pace: setattr(self.prefill, "pace", pace))

    # -- called from request threads -------------------------------------------------------
    def add(self, handle: RequestHandle) -> None:
        """Queue `handle`; Overloaded when the queue is full, InvalidRequest when its tokens could not
        fit the K/V budget even alone."""
        if self.kv_tokens is not None:
            self._check_fits_alone(handle.request)
        with self.work:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded("Model is overloaded: the waiting queue is full")
            self.waiting.append(handle)
            self.work.notify()

    def add_beams(self, job: BeamSearch) -> None:
        """Queue a beam search; its beams run as `job.rows` rows of the batch, and its result or
        exception arrives on `job.future`. Its beams count against the K/V budget once running, but
        do not wait for it (only the check that they could fit alone applies)."""
        if self.kv_tokens is not None:
            self._check_fits_alone(job.request, rows=job.rows)
        with self.work:
            if len(self.waiting) + len(self.beams.waiting) >= self.max_queue:
                raise Overloaded("Model is overloaded: the waiting queue is full")
            self.beams.queue(job)
            self.work.notify()

    @property
    def running(self) -> int:
        """Rows in the batch, the one being prefilled in chunks (it holds a row too) and the beams
        of the running beam searches."""
        batch = self.batch  # read once: the scheduler thread may drop it meanwhile
        return (len(batch) if batch else 0) + (self.chunking is not None) + self.beams.rows

    def request_tokens(self, request) -> int:
        """The K/V tokens `request` may reach (kv/budget.py), what admission reserves for its row."""
        return request_tokens(len(request.prompt_ids), request.stop.max_new_tokens, self.max_model_len)

    @property
    def reserved_tokens(self) -> int:
        """The K/V tokens the running rows (the batch's, the chunked prompt's, the beams') may reach."""
        batch, chunking = self.batch, self.chunking  # read once
        rows = [row for row in (batch.rows if batch else ()) if not row.finished]
        if chunking is not None:
            rows.append(chunking.row)
        return (sum(self.request_tokens(row.request) for row in rows)
                + sum(job.rows * self.request_tokens(job.request) for job in self.beams.running))

    def _check_fits_alone(self, request, rows: int = 1) -> None:
        need = rows * self.request_tokens(request)
        if need > self.kv_tokens:
            beams = f" x {rows} beams" if rows > 1 else ""
            raise InvalidRequest(
                f"This request may reach {need} tokens of K/V (prompt {len(request.prompt_ids)} + max_new_tokens "
                f"{request.stop.max_new_tokens}{beams}), more than the {self.kv_tokens} the memory budget holds "
                f"(option.gpu_memory_utilization): lower max_new_tokens or the prompt")

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running: a step would have nothing to do."""
        return not self.waiting and not self.batch and self.chunking is None and not self.beams

    def wait_for_work(self, timeout: float) -> None:
        with self.work:
            if self.idle:
                self.work.wait(timeout)

    def abort_all(self, reason: str, kind: type[ServingError] = GenerationFailed) -> None:
        """End every waiting and running request with a `kind` failure saying `reason` (engine
        shutdown; a drain's deadline, drain.py). Only once the step loop has stopped."""
        with self.work:
            waiting, self.waiting = list(self.waiting), collections.deque()
        owners = [*waiting, *(row.owner for row in (self.batch.rows if self.batch else ()) if not row.finished)]
        if self.chunking is not None:
            owners.append(self.chunking.row.owner)
        self.batch = self.chunking = None
        for owner in owners:
            owner.push(TokenEvent.failure(reason, kind))
        with self.work:
            jobs = self.beams.take_all()
        for job in jobs:
            job.release()
            settle(job, error=kind(reason))

    # -- the scheduler thread ----------------------------------------------------------------
    def step(self) -> None:
        """One step, in the module docstring's order."""
        if self.idle:
            return  # an idle wake-up is no step: stats.steps and the observer see only steps with work
        with self.phases.measure(ADMIT):  # steps 1-2
            joiners, chunk = self._admit_step()
        decoded = len(self.batch) if self.batch else 0
        with self.prefill.paced(self.batch.rows if self.batch else [], joiners):
            if self.prefill.mixable(self.batch, joiners):  # steps 3-7 in one forward
                self._mixed_step(joiners, chunk)
            else:  # steps 3-4 (prefill), then 5-7 (decode, sample, stop and emit, evict)
                decoded = self._separate_step(joiners, chunk)
        if self.beams:  # step 8
            self._step_beams()
        self.stats.steps += 1
        if self.observer is not None:
            self._report(decoded)

    def _admit_step(self) -> tuple[list[RequestHandle], int]:
        """Steps 1-2: the joiners admitted, and the prompt tokens the chunked prompt may feed."""
        self._drop_cancelled_and_expired()
        self._admit_beams()
        whole = self._step_budget()
        # A beam search's first step prefills its prompt in this step too: its share of the budget.
        room = max(whole - self.beams.prompt_tokens, 0)
        if self.chunking is not None and self.pace is not None:
            self.chunking.crossover = self.pace.crossover
        chunk = self.chunking.cost(room) if self.chunking else 0
        joiners = self._admit(room - chunk, whole)
        if self.chunking is not None and not chunk:  # it started this step: the rest of the budget
            chunk = room - sum(self.prefill.cost(h.request) for h in joiners)
        return joiners, chunk

    def _step_budget(self) -> int:
        """The step's prompt tokens: max_prefill_tokens, or with a pace what fits beside the decode."""
        if self.pace is None:
            return self.max_prefill_tokens
        rows = self.batch.rows if self.batch else []
        return self.pace.tokens(self.max_prefill_tokens, len(rows), decode_context(rows))

    def _separate_step(self, joiners: list[RequestHandle], chunk: int) -> int:
        """Steps 3-7 as forwards of their own; the number of rows decoded."""
        if self.chunking is not None:  # steps 3-4 (prefill.py)
            self._add(self.prefill.advance_chunk(chunk))
        for joined in self.prefill.join(joiners):
            self._add(joined)
        decoded = len(self.batch) if self.batch else 0
        if self.batch:  # steps 5-7
            self._decode()
        return decoded

    def _report(self, decoded: int) -> None:
        prefixes = self.prefixes.stats if self.prefixes is not None else PrefixStats()
        speculated = self.speculation.stats if self.speculation is not None else SpeculationStats()
        self.stats.kv_cache_bytes = held_bytes(self.batch.kv if self.batch else None)
        self.observer.step_finished(StepReport(
            batch_size=decoded, running=self.running, waiting=len(self.waiting) + len(self.beams.waiting),
            prefix_query_tokens=prefixes.prompt_tokens, prefix_hit_tokens=prefixes.hit_tokens,
            prefix_cache_bytes=prefixes.bytes, kv_cache_bytes=self.stats.kv_cache_bytes,
            draft_tokens=speculated.draft_tokens, accepted_draft_tokens=speculated.accepted_tokens))

    def _admit_beams(self) -> None:
        """Drop cancelled beam searches, then start waiting ones while their beams fit."""
        self.beams.drop_cancelled()
        with self.work:
            self.stats.admitted += self.beams.admit(self.max_batch_size - self.running, idle=not self.running)

    def _step_beams(self) -> None:
        self.stats.failed_steps += self.beams.step(lambda: self.phases.measure(DECODE))

    def _drop_cancelled_and_expired(self) -> None:
        now = time.monotonic()
        with self.work:
            keep = collections.deque()
            for handle in self.waiting:
                if handle.cancelled:
                    handle.push(TokenEvent.cancelled())
                    continue
                if handle.cut_off(now):  # its generation deadline: it ends with nothing, as a request of 0 tokens
                    handle.push(TokenEvent.deadline_reached())
                    continue
                if handle.expired(now):
                    handle.push(TokenEvent.failure(
                        f"Request waited {now - handle.submitted_at:.1f} s for a free slot, over predict_timeout",
                        kind=Timeout))
                    continue
                keep.append(handle)
            self.waiting = keep
        owner = self.chunking.row.owner if self.chunking is not None else None
        if owner is not None and (owner.cancelled or owner.cut_off(now)):
            owner.push(TokenEvent.cancelled() if owner.cancelled else TokenEvent.deadline_reached())
            self.chunking = None
        if self.batch:
            for row in self.batch.rows:
                if row.owner.cancelled and not row.finished:
                    row.finished = True
                    row.owner.push(TokenEvent.cancelled())
            self._evict()

    def _admit(self, budget: int | None = None, whole: int | None = None) -> list[RequestHandle]:
        """Joiners whose prompts fit `budget` tokens (by default the step's `whole` budget, by default
        max_prefill_tokens); a prompt over what is left starts the chunked prefill when none runs (it
        takes the rest of this step's budget), or, if it cannot be chunked, goes whole when it would be
        the step's only prefill."""
        whole = self.max_prefill_tokens if whole is None else whole
        budget = whole if budget is None else budget
        free = self.max_batch_size - self.running - self.beams.held(self.max_batch_size)
        joiners: list[RequestHandle] = []
        alone = budget == whole  # no chunk is being continued this step
        room = None if self.kv_tokens is None else self.kv_tokens - self.reserved_tokens
        with self.work:
            while self.waiting and len(joiners) < free:
                request = self.waiting[0].request
                if room is not None:  # the K/V budget: the head waits until rows leave (first come, first served)
                    if self.request_tokens(request) > room:
                        break
                    room -= self.request_tokens(request)
                length = self.prefill.cost(request)
                can_chunk = self.chunks and chunkable(request)
                if length <= budget or (alone and not joiners and not can_chunk):
                    if not self._adapter_slot(self.waiting[0]):
                        break
                    joiners.append(self.waiting.popleft())
                    budget -= length
                    continue
                if can_chunk and self.chunking is None and budget > 0 and self._adapter_slot(self.waiting[0]):
                    self.chunking = self.prefill.start(self.waiting.popleft())
                    self.chunking.row.owner.admitted()
                break
        for handle in joiners:
            handle.admitted()
        return joiners

    def _adapter_slot(self, handle: RequestHandle) -> bool:
        """Give the head of the queue its adapter's slot (none needed without an adapter); False when
        no slot is free of running rows now, so it waits. A folder that cannot be read again (after an
        eviction) fails the request alone (False too: the next step looks at the next request)."""
        if handle.adapter is None or handle.adapter_slot is not None:
            return True
        try:
            slot = self.adapters.acquire(handle.adapter)
        except AdapterError as exc:
            self.waiting.popleft()
            handle.push(TokenEvent.failure(f"Adapter {handle.adapter.name} could not be loaded: {exc}",
                                           kind=GenerationFailed))
            return False
        if slot is None:
            return False
        handle.adapter_slot = slot
        return True

    def _add(self, batch: Batch | None) -> None:
        """Merge newly prefilled rows into the running batch."""
        if batch is None:
            return
        if self.batch is None:
            self.batch = batch
        else:
            with self.phases.measure(EVICT):
                self.batch.concatenate(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(self.batch))

    def _decode(self) -> None:
        """Steps 5-7: one decode forward (decode.py), its events delivered, finished rows evicted."""
        self._decoded(self.decode.run(self.batch))

    def _decoded(self, events: list[tuple[Row, TokenEvent]] | None) -> None:
        """Deliver a decode's events and evict the finished rows; None (the decode failed, and its rows
        with it): drop the batch."""
        if events is None:
            self.batch = None
            return
        self.ops.deliver(events)
        self._evict()

    def _mixed_step(self, joiners: list[RequestHandle], chunk_budget: int) -> None:
        """Steps 3-7 in one forward (prefill.py `mixed_forward`): the running rows go on as in `_decode`,
        then the joiners whose prompts are all in join; if the forward raised, its parts run separately."""
        mixed = self.prefill.mixed_forward(self.batch, joiners, chunk_budget)
        if mixed is None:
            self._separate_step(joiners, chunk_budget)
            return
        self.stats.mixed_steps += 1
        self._decoded(self.decode.run(self.batch, forwarded=True))  # the forward left the logits
        self._add(self.prefill.mixed_joined(mixed))

    def _evict(self) -> None:
        with self.phases.measure(EVICT):
            self.batch.evict_finished()
        if not len(self.batch):
            self.batch = None
