"""EngineObserver: the neutral hook through which the engine reports what it did, for metrics.

The engine knows when a sequence was queued, admitted, got its tokens and ended, and how full
each step was; it reports those facts in seconds and counts, and knows nothing of who listens
(metrics.py turns them into Prometheus series, outside this folder). Every method is called on
the scheduler thread, so an observer must be quick: a histogram observe per token is the budget.

`SequenceClock` keeps one sequence's times; its RequestHandle feeds it every event it pushes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import ServingError
from .types import FinishReason, TokenEvent


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


@dataclass(frozen=True)
class StepReport:
    """One scheduler step, at its end."""

    batch_size: int  # rows the step's decode forward ran (0: no decode this step)
    running: int  # rows held after the step
    waiting: int  # requests and beam searches still queued
    prefix_query_tokens: int = 0  # cumulative, with prefix caching: prompt tokens looked up
    prefix_hit_tokens: int = 0  # cumulative: of those, tokens whose K/V came from the cache
    prefix_cache_bytes: int = 0  # held now


class EngineObserver:
    """Does nothing; an observer overrides what it needs."""

    def sequence_admitted(self, queue_seconds: float) -> None: ...

    def first_token(self, prompt_tokens: int, seconds: float) -> None: ...

    def next_token(self, gap_seconds: float) -> None: ...

    def sequence_finished(self, report: SequenceReport) -> None: ...

    def step_finished(self, report: StepReport) -> None: ...


class SequenceClock:
    """One sequence's times, from submission to its last event, reported to an observer."""

    __slots__ = ("observer", "prompt_tokens", "submitted", "admitted", "first", "last", "tokens", "adapter")

    def __init__(self, observer: EngineObserver, prompt_tokens: int, submitted: float, adapter: str | None = None):
        self.observer, self.prompt_tokens, self.submitted = observer, prompt_tokens, submitted
        self.adapter = adapter
        self.admitted: float | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def admit(self) -> None:
        self.admitted = time.monotonic()
        self.observer.sequence_admitted(self.admitted - self.submitted)

    def event(self, event: TokenEvent) -> None:
        now = time.monotonic()
        if event.token_id >= 0:  # a failure or cancellation marker is no token
            self.tokens += 1
            if self.first is None:
                self.first = now
                self.observer.first_token(self.prompt_tokens, now - self.submitted)
            else:
                self.observer.next_token(now - self.last)
            self.last = now
        if event.finish_reason is not None:
            self._finish(event, now)

    def _finish(self, event: TokenEvent, now: float) -> None:
        failed = event.finish_reason is FinishReason.ERROR
        self.observer.sequence_finished(SequenceReport(
            finish_reason=event.finish_reason, error_kind=event.error_kind if failed else None,
            prompt_tokens=self.prompt_tokens, generated_tokens=self.tokens, e2e_seconds=now - self.submitted,
            queue_seconds=None if self.admitted is None else self.admitted - self.submitted,
            first_token_seconds=None if self.first is None else self.first - self.submitted,
            decode_seconds=None if self.first is None else self.last - self.first, adapter=self.adapter))
