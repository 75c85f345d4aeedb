"""The one rule for a forward that raises (a prefill, a chunk of one, a decode): the requests it
concerns fail, the step counts as failed, and the scheduler goes on with the others.

    with guarded_forward(rows, stats, "Decode step failed") as forward:
        ...  # the forward, then the sampling and events that follow it
    if forward.failed:
        ...  # what the caller must drop (the batch, the chunked prompt)

A CUDA out-of-memory is such an exception too: the step's rows fail, the exception lets go of the
step's tensors (its traceback holds their frames) and torch's cache is emptied, so the next step
starts with the memory the failed one held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

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
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            release_memory(exc)


def release_memory(exc: BaseException) -> None:
    """After an out-of-memory: drop `exc`'s traceback (its frames hold the failed step's tensors) and
    give torch's cached blocks back, so the engine goes on serving."""
    exc.__traceback__ = None
    torch.cuda.empty_cache()
    log.warning("CUDA out of memory in a step: its rows failed, the cache was emptied; lower "
                "option.gpu_memory_utilization if this recurs")


def fail_rows(rows: Iterable[Row], exc: BaseException) -> None:
    """End `rows` with a failure event naming `exc`."""
    for row in rows:
        row.finished = True
        row.owner.push(TokenEvent.failure(f"exception occurred during rolling batch inference: {exc}"))
