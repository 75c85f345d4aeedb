"""Engine: the rolling-batch text generator one model process owns.

`generate(requests)` queues every sequence of one client request and returns their Generation at
once (or raises Overloaded when the waiting queue is full); the scheduler thread does the rest.
The engine imports no Flask, no JSON and no dialect names: dialects build GenerationRequests and
render TokenEvents.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from lmi_serve.engine.adapters import Adapters
from lmi_serve.engine.beams.rows import BeamSearch, replay
from lmi_serve.engine.generation import POLL_SECONDS, Generation
from lmi_serve.engine.handle import RequestHandle, Sink
from lmi_serve.engine.kv.prefix_cache import PrefixCache, PrefixStats
from lmi_serve.engine.kv.protocol import KVLayout
from lmi_serve.engine.kv.select import is_encoder_decoder
from lmi_serve.engine.memory import IdleTrim
from lmi_serve.engine.observer import EngineObserver
from lmi_serve.engine.phases import PhaseTimes
from lmi_serve.engine.policy import max_model_len as capped_model_len
from lmi_serve.engine.policy import vocab_size
from lmi_serve.engine.sampling.grammar import GrammarCompiler
from lmi_serve.engine.sampling.watermark import Watermark
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.speculation import NgramSpeculation, SpeculationStats
from lmi_serve.engine.static_batch import eos_token_ids
from lmi_serve.engine.support import check_supported, takes_images
from lmi_serve.engine.types import GenerationRequest, GenerationResult
from lmi_serve.errors import ClientGone, GenerationFailed, InvalidRequest, NotFound, ServingError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters; each dialect renders it in its own words."""

    running: int  # rows in the batch now
    waiting: int  # requests (and beam searches) queued for rows
    steps: int
    prefills: int
    admitted: int  # requests that got a row, ever
    largest_batch: int
    failed_steps: int  # steps whose forward raised (their rows failed; the engine went on)
    max_batch_size: int
    mixed_steps: int  # steps whose joiners' prompts rode in the decode forward (kv/mixed.py)
    phases: PhaseTimes  # where the steps' time went (phases.py): seconds and counts per phase
    kv_cache_bytes: int = 0  # K/V storage the running rows held at the last step's end
    prefix_cache: PrefixStats | None = None  # with prefix caching: lookups, hits, tokens reused, memory
    speculation: SpeculationStats | None = None  # with n-gram speculation: verifying steps, drafts, accepted


class Engine:
    def __init__(self, model, tokenizer, device, *, max_batch_size: int = 32, max_queue: int = 1000,
                 predict_timeout: float | None = None, max_model_len: int | None = None,
                 max_prefill_tokens: int = 512, name: str = "model", kv_layout: KVLayout | None = None,
                 prefix_cache: PrefixCache | None = None, watermark: Watermark | None = None,
                 adapters: Adapters | None = None, kv_tokens: int | None = None,
                 speculation: NgramSpeculation | None = None, mixed_steps: bool = True,
                 step_seconds: float | None = None, generation_deadline: float | None = None):
        """`adapters`: the model's LoRA adapters (adapters.py; the model wrapped by model/lora.py), which
        requests name in `GenerationRequest.adapter`; None: LoRA is off and such requests are refused.
        `kv_tokens`: the K/V budget in tokens (kv/budget.py, on a GPU); None: no bound. `speculation`:
        n-gram drafts for a batch of one row (speculation.py); None: off. `mixed_steps`: joiners' prompts go
        through the running rows' decode forward where the KV layout can pack them (kv/mixed.py).
        `step_seconds`: what a step that prefills may take, its prompt-token budget paced to it (pace.py);
        None: tokens alone. `generation_deadline`: seconds from submission after which a sequence ends
        with what it has, LENGTH with `TokenEvent.deadline_cut` (beam searches excepted); None: never."""
        check_supported(model)  # UnsupportedModel: a model the engine would answer wrongly never loads
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.name = name
        self.encoder_decoder = is_encoder_decoder(model)
        self.takes_images = takes_images(model)  # a vision-language model: requests may carry images
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.max_model_len = capped_model_len(model, max_model_len)
        self.predict_timeout = predict_timeout
        self.generation_deadline = generation_deadline
        self.vocab_size = vocab_size(model, tokenizer)  # the logits' width
        self.grammars = GrammarCompiler(tokenizer, max(self.vocab_size, len(tokenizer)), self.eos_token_ids)
        self.watermark = watermark  # None: requests asking for a watermark are refused
        self.scheduler = Scheduler(model, tokenizer, device, max_batch_size=max_batch_size, max_queue=max_queue,
                                   max_prefill_tokens=max_prefill_tokens, kv_layout=kv_layout,
                                   prefix_cache=prefix_cache, adapters=adapters, kv_tokens=kv_tokens,
                                   max_model_len=self.max_model_len, speculation=speculation,
                                   mixed_steps=mixed_steps, step_seconds=step_seconds)
        self.adapters = adapters
        self.observer: EngineObserver | None = None  # observe() sets it (metrics)
        self.failure: str | None = None  # set by fail(): the model cannot serve any more
        self._stopped = threading.Event()
        self.idle_trim = IdleTrim()  # the heap's freed pages go back once the engine idles (memory.py)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)

    def observe(self, observer: EngineObserver) -> None:
        """Report every sequence submitted from now on, and every step, to `observer` (observer.py)."""
        self.observer = observer
        self.scheduler.observer = observer

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, reason: str = "the engine stopped", kind: type[ServingError] = GenerationFailed) -> None:
        """Stop the loop, then end every request still waiting or running (nobody is left to) with
        a `kind` failure saying `reason`: each dialect renders it as its own error (event)."""
        self._stopped.set()
        with self.scheduler.work:
            self.scheduler.work.notify()
        self._thread.join(timeout=10)
        self.scheduler.abort_all(reason, kind)

    def fail(self, reason: str) -> None:
        """The model broke under the engine (a tensor-parallel rank died, model/tp.py): remember why
        (the model's status turns failed, service.py), then stop, ending every request with `reason`.
        Called from the scheduler thread itself (a step's forward found the break), the stop runs on
        a thread of its own, which waits for the step to end."""
        self.failure = reason
        if threading.current_thread() is self._thread:
            threading.Thread(target=self.stop, args=(reason,), name=f"engine-{self.name}-fail", daemon=True).start()
        else:
            self.stop(reason)

    def submit(self, request: GenerationRequest, *, sink: Sink | None = None, index: int = 0) -> RequestHandle:
        """Queue one sequence. Raises GrammarError (a ValueError) for an invalid `guided` grammar,
        Overloaded when the waiting queue is full, InvalidRequest for prompt logprobs from an
        encoder-decoder model, for a watermark from an engine made without one or for images to a
        model that takes none, NotFound for an
        adapter that is not registered. Dialects use `generate`."""
        if request.prompt_logprobs and self.encoder_decoder:
            raise InvalidRequest("This model is an encoder-decoder model: its prompt is the encoder's input, which "
                                 "gets no logprobs (decoder_input_details, prompt_logprobs, echo with logprobs)")
        constraint = self.grammars.constraint(request.guided) if request.guided is not None else None
        now = time.monotonic()
        deadline = now + self.predict_timeout if self.predict_timeout else None
        cutoff = now + self.generation_deadline if self.generation_deadline else None
        if request.sampling.watermark and self.watermark is None:
            raise InvalidRequest("This model's engine has no watermark configured")
        if request.images is not None and not self.takes_images:
            raise InvalidRequest("This model takes text only: its forward has no pixel_values")
        watermark = self.watermark if request.sampling.watermark else None
        adapter = self._lease(request.adapter) if request.adapter is not None else None
        handle = RequestHandle(request, deadline, constraint, sink=sink, index=index, watermark=watermark,
                               observer=self.observer, adapter=adapter, adapters=self.adapters, cutoff=cutoff)
        try:
            self.scheduler.add(handle)
        except BaseException:
            if adapter is not None:
                self.adapters.release(adapter, admitted=False)
            raise
        return handle

    def _lease(self, name: str):
        """The registered adapter `name`, kept until the request ends; NotFound naming it otherwise."""
        if self.adapters is None:
            raise NotFound(f"Adapter {name} is not registered (LoRA adapters are off: option.enable_lora)",
                           param="adapter")
        return self.adapters.lease(name)

    def generate(self, requests: Sequence[GenerationRequest]) -> Generation:
        """Queue every sequence of one client request, or none: if one cannot be queued (Overloaded,
        GrammarError), the ones already queued are cancelled and the error is raised."""
        sink: Sink = queue.SimpleQueue()
        handles: list[RequestHandle] = []
        try:
            for index, request in enumerate(requests):
                handles.append(self.submit(request, sink=sink, index=index))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return Generation(handles, sink)

    def submit_beams(self, request: GenerationRequest, num_beams: int) -> BeamSearch:
        """Queue a beam search: its `num_beams` beams run as rows of the rolling batch, one token
        per step (beams/rows.py). Its hypotheses arrive on the job's `future`; `cancel()` frees its
        rows at the next step. Raises Overloaded when the waiting queue is full, InvalidRequest for an
        adapter (beams run on the base model only)."""
        if request.adapter is not None:
            if self.adapters is None or request.adapter not in self.adapters:
                self._lease(request.adapter)  # NotFound, naming it
            raise InvalidRequest("Beam search with a LoRA adapter is not supported; use greedy or sampled decoding")
        if request.images is not None:  # a beam search prefills through its own path, which carries no images
            raise InvalidRequest("Beam search with images is not supported; use greedy or sampled decoding")
        job = BeamSearch(request, num_beams, self.model, self.scheduler.kv_layout,
                         pad_id=self.tokenizer.pad_token_id, device=self.device)
        self.scheduler.add_beams(job)
        return job

    def beam_search(self, request: GenerationRequest, num_beams: int,
                    client_gone: Callable[[], bool] | None = None) -> list[GenerationResult]:
        """Beam search for one request, stepped with the rolling batch; blocks until done. Returns
        every beam, best first (transformers' beam order). The search is dropped (its rows freed at
        the next step) if the waiting thread is interrupted, or, checked every POLL_SECONDS, when
        `client_gone()` says the client left: then ClientGone is raised."""
        job = self.submit_beams(request, num_beams)
        try:
            while True:
                try:
                    hypotheses = job.future.result(POLL_SECONDS if client_gone is not None else None)
                    break
                except FutureTimeout:
                    if client_gone():
                        raise ClientGone("The client closed the connection before the beam search ended") from None
        except BaseException:
            job.cancel()
            raise
        return replay(request, self.tokenizer, hypotheses)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        prefixes, speculation = self.scheduler.prefixes, self.scheduler.speculation
        return EngineStats(running=self.scheduler.running,
                           waiting=len(self.scheduler.waiting) + len(self.scheduler.beams.waiting), steps=s.steps,
                           prefills=s.prefills, admitted=s.admitted, largest_batch=s.largest_batch,
                           failed_steps=s.failed_steps, max_batch_size=self.scheduler.max_batch_size,
                           mixed_steps=s.mixed_steps, phases=self.scheduler.phases.snapshot(),
                           kv_cache_bytes=s.kv_cache_bytes,
                           prefix_cache=replace(prefixes.stats) if prefixes is not None else None,
                           speculation=replace(speculation.stats) if speculation is not None else None)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self.scheduler.wait_for_work(timeout=0.5)
            try:
                self.scheduler.step()
            except Exception:  # step() isolates request failures; this guards the loop itself
                log.exception("Engine %s: unexpected error in a step", self.name)
            self.idle_trim.tick(busy=not self.scheduler.idle)
