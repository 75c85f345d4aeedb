"""Generation: every sequence of one client request, from submission to the end of its reading.

One client request may ask for several sequences (n, best_of, a list of prompts). The engine
pushes every sequence's events into the Generation's one queue, and a dialect reads them through
one of three doors:

- `start()` before committing to a status line: waits for the first event and raises the
  failure's kind if the request failed before generating anything (a queue timeout, a failed
  prefill), so a stream still gets a real status code;
- `events()` for a stream: (sequence index, event) in arrival order until every sequence ended;
- `results(client_gone)` for a whole response: every sequence's events, index-aligned, raising
  a failure that came before any token like `start()`; it checks `client_gone` each time it wakes
  (an event arrived, or `POLL_SECONDS` passed) and raises ClientGone if the client left.

Leaving the Generation by any path (all done, an exception, a stream generator closed because the
client went away, `close()`, the `with` block's end) cancels every sequence still running: the
engine drops them at its next step. This is the only place a dialect's request is cancelled.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence

from lmi_serve.engine.handle import RequestHandle, Sink
from lmi_serve.engine.types import GenerationResult, TokenEvent
from lmi_serve.errors import ClientGone

# How long `results` waits for an event before it asks `client_gone` again. A running request gets
# an event every engine step, so the check runs at least once per step; this bounds it for a
# request still waiting for a row (or in a long prefill).
POLL_SECONDS = 0.05


class Generation:
    def __init__(self, handles: Sequence[RequestHandle], sink: Sink):
        self.handles = list(handles)
        self._sink = sink
        self._buffered: list[tuple[int, TokenEvent]] = []  # read by start(), not yet handed out
        self._events: list[list[TokenEvent]] = [[] for _ in self.handles]
        self._running = len(self.handles)

    @property
    def requests(self):
        return [handle.request for handle in self.handles]

    def close(self) -> None:
        """Cancel every sequence that has not ended (a no-op for the ended ones)."""
        for handle in self.handles:
            handle.cancel()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _read(self, timeout: float | None) -> tuple[int, TokenEvent] | None:
        try:
            index, event = self._sink.get(timeout=timeout)
        except queue.Empty:
            return None
        self._events[index].append(event)
        if event.finish_reason is not None:
            self._running -= 1
        return index, event

    def _raise_if_failed_before_start(self, index: int, event: TokenEvent) -> None:
        if event.error is not None and len(self._events[index]) == 1:
            self.close()
            event.raise_failure()

    def start(self) -> None:
        """Wait for the first event; a request that failed before generating anything raises its
        kind here (and is closed)."""
        if self._buffered or self._running == 0:
            return
        try:
            item = self._read(None)
        except BaseException:
            self.close()
            raise
        self._raise_if_failed_before_start(*item)
        self._buffered.append(item)

    def events(self) -> Iterator[tuple[int, TokenEvent]]:
        """(sequence index, event) in arrival order until every sequence has ended; closing this
        generator (the client went away) or an exception in the reader cancels the rest."""
        try:
            while self._buffered:
                yield self._buffered.pop(0)
            while self._running:
                yield self._read(None)
        finally:
            self.close()

    def results(self, client_gone: Callable[[], bool] | None = None) -> list[GenerationResult]:
        """Every sequence's events, index-aligned; see the module docstring for what raises."""
        try:
            self._buffered.clear()  # already recorded in self._events
            while self._running:
                item = self._read(POLL_SECONDS if client_gone is not None else None)
                if item is not None:
                    self._raise_if_failed_before_start(*item)
                if client_gone is not None and client_gone():
                    raise ClientGone("The client closed the connection before the response was complete")
        finally:
            self.close()
        return [GenerationResult(len(handle.request.prompt_ids), events)
                for handle, events in zip(self.handles, self._events)]
