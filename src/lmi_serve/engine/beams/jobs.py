"""The scheduler's beam searches (beams/rows.py): those waiting for rows, in order, and those running,
each advanced one token per scheduler step.

A search's k beams count as k rows against max_batch_size. The first waiting search holds the free
rows until enough are free for it, so a stream of ordinary requests cannot starve it; a search
wider than the whole batch starts when nothing else runs. A cancelled search is dropped at the next
step, before admission, so its rows go to that step's joiners; a search that raises fails alone.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from lmi_serve.engine.beams.rows import BeamSearch

log = logging.getLogger(__name__)


class BeamJobs:
    """Waiting and running beam searches. `queue` runs on request threads under the scheduler's
    lock, `admit` on the scheduler thread under it too; `rows` may be read from any thread."""

    def __init__(self):
        self.waiting: collections.deque[BeamSearch] = collections.deque()
        self.running: list[BeamSearch] = []  # replaced, never changed in place: readers see one list

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def rows(self) -> int:
        """Batch rows the running searches hold: k each."""
        return sum(job.rows for job in self.running)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the running searches prefill in their next step (those that have not started)."""
        return sum(job.prompt_pending for job in self.running)

    def queue(self, job: BeamSearch) -> None:
        self.waiting.append(job)

    def drop_cancelled(self) -> None:
        """Forget the running searches whose callers cancelled them, and free their KV."""
        if any(job.cancelled for job in self.running):
            for job in self.running:
                if job.cancelled:
                    job.release()
            self.running = [job for job in self.running if not job.cancelled]

    def admit(self, free: int, idle: bool) -> int:
        """Start waiting searches, in order, while their beams fit in `free` rows (or, when `idle`,
        the first one whatever its width); returns how many started."""
        started = 0
        while self.waiting:
            job = self.waiting[0]
            if job.cancelled:
                self.waiting.popleft()
                continue
            if not idle and job.rows > free:
                break
            self.running = [*self.running, self.waiting.popleft()]
            free, idle, started = free - job.rows, False, started + 1
        return started

    def held(self, max_rows: int) -> int:
        """Free rows that the first waiting search holds until it has all it needs."""
        first = self.waiting[0] if self.waiting else None
        return min(first.rows, max_rows) if first is not None and not first.cancelled else 0

    def step(self, measure: Callable[[], AbstractContextManager[Any]]) -> int:
        """Advance every running search one token (each inside `measure()`); a finished one gets
        its result. Returns how many failed (each gets its exception)."""
        still: list[BeamSearch] = []
        failures = 0
        for job in self.running:
            if job.cancelled:  # cancelled during this step: dropped without another forward
                job.release()
                continue
            try:
                with measure():
                    finished = job.step()
            except Exception as exc:
                failures += 1
                log.exception("A beam search step failed; failing that request only")
                job.release()
                settle(job, error=exc)
                continue
            if finished:
                settle(job, result=job.hypotheses())
            else:
                still.append(job)
        self.running = still
        return failures

    def take_all(self) -> list[BeamSearch]:
        """Remove every search, waiting or running (the caller holds the scheduler's lock)."""
        jobs = [*self.running, *self.waiting]
        self.running, self.waiting = [], collections.deque()
        return jobs


def settle(job: BeamSearch, *, result: Any = None, error: BaseException | None = None) -> None:
    """Hand a search its result or error, unless its caller cancelled it meanwhile."""
    if job.future.done():
        return
    try:
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
    except Exception:  # InvalidStateError: cancelled between the check and the set
        pass
