"""RequestHandle: one sequence's place in the engine, between the scheduler thread and its reader."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator

from lmi_serve.engine.observer import EngineObserver, SequenceClock
from lmi_serve.engine.types import GenerationRequest, GenerationResult, TokenEvent

_ids = itertools.count(1)

Sink = queue.SimpleQueue  # of (sequence index, TokenEvent)


class RequestHandle:
    """The engine pushes TokenEvents until the one carrying a finish_reason; every failure,
    including a queue timeout, is such a terminal event (`TokenEvent.failure`, with its kind).

    Events go to `sink` as (index, event): a Generation gives all its sequences one sink, so one
    reader sees them in arrival order. A handle made alone has a sink of its own and can be
    iterated directly (engine tests do). `cancel()` asks the engine to drop the sequence at its
    next step; dialects never call it: leaving a Generation does.
    """

    def __init__(self, request: GenerationRequest, deadline: float | None, constraint=None, *,
                 sink: Sink | None = None, index: int = 0, watermark=None,
                 observer: EngineObserver | None = None, adapter=None, adapters=None,
                 cutoff: float | None = None):
        self.id = next(_ids)
        self.request = request
        self.constraint = constraint  # the engine's grammar state for a guided request
        self.watermark = watermark  # the engine's Watermark for a request that asks for one
        self.deadline = deadline  # monotonic time by which the request must have been admitted
        # Monotonic time at which it ends with what it has (the generation deadline); None: never.
        self.cutoff = cutoff
        self.submitted_at = time.monotonic()
        self.cancelled = False
        self.index = index
        # A leased LoRA adapter (engine/adapters.py), returned with the terminal event; its slot once admitted.
        self.adapter, self._adapters = adapter, adapters
        self.adapter_slot: int | None = None
        # Only an observed sequence pays for its clock (observer.py): a clock read per event.
        self.clock = SequenceClock(observer, len(request.prompt_ids), self.submitted_at,
                                                request.adapter) if observer else None
        self._sink: Sink = sink if sink is not None else queue.SimpleQueue()

    def push(self, event: TokenEvent) -> None:
        if self.clock is not None:
            self.clock.event(event)
        if event.finish_reason is not None and self.adapter is not None:  # before the reader sees the end
            self._adapters.release(self.adapter, admitted=self.adapter_slot is not None)
            self.adapter = None
        self._sink.put((self.index, event))

    def admitted(self) -> None:
        """The scheduler gave this sequence a row (its queue time ends)."""
        if self.clock is not None:
            self.clock.admit()

    def cancel(self) -> None:
        self.cancelled = True

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    def cut_off(self, now: float) -> bool:
        """Its generation deadline has passed."""
        return self.cutoff is not None and now >= self.cutoff

    def __iter__(self) -> Iterator[TokenEvent]:
        """This handle's events, for a handle made alone (its sink is its own)."""
        while True:
            _, event = self._sink.get()
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> GenerationResult:
        """Wait for the whole generation (a handle made alone)."""
        result = GenerationResult(len(self.request.prompt_ids))
        result.events.extend(self)
        return result
