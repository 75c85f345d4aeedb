"""EngineObserver: the neutral hook through which the engine reports what it did, for metrics.

The engine knows when a sequence was queued, admitted, got its tokens and ended, and how full
each step was; it reports those facts in seconds and counts, and knows nothing of who listens
(metrics.py turns them into Prometheus series, outside this folder). Every method is called on
the scheduler thread, so an observer must be quick: a histogram observe per token is the budget.

`SequenceClock` keeps one sequence's times; its RequestHandle feeds it every event it pushes. A
clock made while a `RequestTally` is current (`CURRENT_TALLY`, set by whoever serves one client
request) also adds its sequence to that tally: the request's own counts, times (admission, first
token, last event) and how its sequences ended, read once the request is over (the access log, and
the request's trace span: server/tracing.py).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import ServingError


@dataclass(frozen=True)
class SequenceReport:
    """One sequence, at its end. Times are seconds; None where the sequence never got there."""

    finish_reason: FinishReason
    error_kind: type[ServingError] | None  # with FinishReason.ERROR: the failure's kind
    prompt_tokens: int
    generated_tokens: int
    e2e_seconds: float  # submission to the last event
    queue_seconds: float | None  # submission to admission (None: never admitted)
    first_token_seconds: float | None  # submission to the first token
    decode_seconds: float | None  # first token to last token (for the time per output token)
    adapter: str | None = None  # the LoRA adapter it ran on (None: the base model)
    deadline_cut: bool = False  # its generation deadline ended it (finish_reason LENGTH)


@dataclass(frozen=True)
class StepReport:
    """One scheduler step, at its end."""

    batch_size: int  # rows the step's decode forward ran (0: no decode this step)
    running: int  # rows held after the step
    waiting: int  # requests and beam searches still queued
    prefix_query_tokens: int = 0  # cumulative, with prefix caching: prompt tokens looked up
    prefix_hit_tokens: int = 0  # cumulative: of those, tokens whose K/V came from the cache
    prefix_cache_bytes: int = 0  # held now
    kv_cache_bytes: int = 0  # K/V storage the rolling batch's rows hold now (kv/protocol.py held_bytes)
    draft_tokens: int = 0  # cumulative, with n-gram speculation: draft tokens verified
    accepted_draft_tokens: int = 0  # cumulative: of those, tokens the engine chose


class EngineObserver:
    """Does nothing; an observer overrides what it needs."""

    def sequence_admitted(self, queue_seconds: float) -> None: ...

    def first_token(self, prompt_tokens: int, seconds: float) -> None: ...

    def next_token(self, gap_seconds: float) -> None: ...

    def sequence_finished(self, report: SequenceReport) -> None: ...

    def step_finished(self, report: StepReport) -> None: ...


@dataclass
class RequestTally:
    """The sequences one client request submitted, summed: written by the scheduler thread (one
    writer), read by the request's thread once its response is over. Times are time.monotonic()."""

    sequences: int = 0
    prompt_tokens: int = 0  # per sequence, as lmi_serve:prompt_tokens_total counts (n=2 counts twice)
    generated_tokens: int = 0
    submitted: float | None = None  # the first sequence's submission
    admitted: float | None = None  # the earliest admission of any sequence into the batch
    first_token: float | None = None  # the earliest first token of any sequence
    finished: float | None = None  # the last sequence's last event
    finish_reasons: list[FinishReason] = field(default_factory=list)  # one per sequence ended, in order
    error_kind: type[ServingError] | None = None  # the first failed sequence's kind
    deadline_cuts: int = 0  # sequences their generation deadline ended

    def add(self, prompt_tokens: int, submitted: float) -> None:
        self.sequences += 1
        self.prompt_tokens += prompt_tokens
        if self.submitted is None or submitted < self.submitted:
            self.submitted = submitted

    def admit(self, now: float) -> None:
        if self.admitted is None or now < self.admitted:
            self.admitted = now

    def end(self, reason: FinishReason, now: float, error_kind: type[ServingError] | None) -> None:
        self.finish_reasons.append(reason)
        if error_kind is not None and self.error_kind is None:
            self.error_kind = error_kind
        if self.finished is None or now > self.finished:
            self.finished = now

    @property
    def queue_seconds(self) -> float | None:
        """Submission to the first admission into the batch; None when no sequence was admitted."""
        if self.admitted is None or self.submitted is None:
            return None
        return self.admitted - self.submitted

    @property
    def ttft_seconds(self) -> float | None:
        """Submission to the request's first token; None when no token came."""
        if self.first_token is None or self.submitted is None:
            return None
        return self.first_token - self.submitted


# The tally of the client request being served on this thread (None: nobody is counting).
CURRENT_TALLY: ContextVar[RequestTally | None] = ContextVar("lmi_serve_request_tally", default=None)


class SequenceClock:
    """One sequence's times, from submission to its last event, reported to an observer (and to
    the current request's tally, if any)."""

    __slots__ = ("observer", "prompt_tokens", "submitted", "admitted", "first", "last", "tokens", "tally", "adapter")

    def __init__(self, observer: EngineObserver, prompt_tokens: int, submitted: float, adapter: str | None = None):
        self.observer, self.prompt_tokens, self.submitted = observer, prompt_tokens, submitted
        self.adapter = adapter
        self.admitted: float | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.tally = CURRENT_TALLY.get()  # made on the request's thread (Engine.submit)
        if self.tally is not None:
            self.tally.add(prompt_tokens, submitted)

    def admit(self) -> None:
        self.admitted = time.monotonic()
        if self.tally is not None:
            self.tally.admit(self.admitted)
        self.observer.sequence_admitted(self.admitted - self.submitted)

    def event(self, event: TokenEvent) -> None:
        now = time.monotonic()
        if event.token_id >= 0:  # a failure or cancellation marker is no token
            self.tokens += 1
            if self.tally is not None:
                self.tally.generated_tokens += 1
            if self.first is None:
                self.first = now
                if self.tally is not None and (self.tally.first_token is None or now < self.tally.first_token):
                    self.tally.first_token = now
                self.observer.first_token(self.prompt_tokens, now - self.submitted)
            else:
                self.observer.next_token(now - self.last)
            self.last = now
        if event.finish_reason is not None:
            self._finish(event, now)

    def _finish(self, event: TokenEvent, now: float) -> None:
        failed = event.finish_reason is FinishReason.ERROR
        if self.tally is not None:
            self.tally.end(event.finish_reason, now, event.error_kind if failed else None)
        if event.deadline_cut and self.tally is not None:
            self.tally.deadline_cuts += 1
        self.observer.sequence_finished(SequenceReport(
            finish_reason=event.finish_reason, error_kind=event.error_kind if failed else None,
            prompt_tokens=self.prompt_tokens, generated_tokens=self.tokens, e2e_seconds=now - self.submitted,
            queue_seconds=None if self.admitted is None else self.admitted - self.submitted,
            first_token_seconds=None if self.first is None else self.first - self.submitted,
            decode_seconds=None if self.first is None else self.last - self.first, adapter=self.adapter,
            deadline_cut=event.deadline_cut))
