"""The one rule for a forward that raises (a prefill, a chunk of one, a decode): the requests it
concerns fail, the step counts as failed, and the scheduler goes on with the others.

    with guarded_forward(rows, stats, "Decode step failed") as forward:
        ...  # the forward, then the sampling and events that follow it
    if forward.failed:
        ...  # what the caller must drop (the batch, the chunked prompt)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from lmi_serve.engine.batch import Row
from lmi_serve.engine.types import TokenEvent

log = logging.getLogger("lmi_serve.engine.scheduler")  # the scheduler's log, where these lines always were


class FailureCount(Protocol):
    failed_steps: int


@dataclass
class Outcome:
    """What became of a guarded forward: `error` is what it raised, None when it succeeded."""

    error: Exception | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@contextmanager
def guarded_forward(rows: Sequence[Row], stats: FailureCount, failure: str | None) -> Iterator[Outcome]:
    """Run the body (a forward on `rows` and what follows it); if it raises, count a failed step in
    `stats` and keep the exception in the outcome. With `failure` (the log line) `rows` then fail
    with it; with None they are left to the caller (a group prefill retries each row alone)."""
    outcome = Outcome()
    try:
        yield outcome
    except Exception as exc:
        outcome.error = exc
        stats.failed_steps += 1
        if failure is not None:
            log.exception(failure)
            fail_rows(rows, exc)


def fail_rows(rows: Iterable[Row], exc: BaseException) -> None:
    """End `rows` with a failure event naming `exc`."""
    for row in rows:
        row.finished = True
        row.owner.push(TokenEvent.failure(f"exception occurred during rolling batch inference: {exc}"))
