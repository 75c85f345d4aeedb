"""RequestHandle: one request's event stream between the scheduler thread and its consumer."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator

from .types import GenerationRequest, GenerationResult, TokenEvent

_ids = itertools.count(1)


class RequestHandle:
    """Iterate it to receive TokenEvents until the one carrying a finish_reason.

    The engine either pushes events or fails the handle with an exception (raised to the consumer
    before any event, e.g. a timeout while waiting for a slot). `cancel()` asks the engine to drop
    the request at its next step; closing a consumer's generator should call it.
    """

    def __init__(self, request: GenerationRequest, deadline: float | None, constraint=None):
        self.id = next(_ids)
        self.request = request
        self.constraint = constraint  # the engine's grammar state for a guided request
        self.deadline = deadline  # monotonic time by which the request must have been admitted
        self.submitted_at = time.monotonic()
        self.cancelled = False
        self._events: queue.SimpleQueue[TokenEvent | BaseException] = queue.SimpleQueue()

    def push(self, event: TokenEvent) -> None:
        self._events.put(event)

    def fail(self, error: BaseException) -> None:
        self._events.put(error)

    def cancel(self) -> None:
        self.cancelled = True

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    def next_event(self, timeout: float) -> TokenEvent | None:
        """The next event, or None when `timeout` seconds pass without one (the failure, if the
        engine failed the handle, is raised): for a consumer that checks something between events."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def result(self) -> GenerationResult:
        """Wait for the whole generation."""
        result = GenerationResult(len(self.request.prompt_ids))
        result.events.extend(self)
        return result
