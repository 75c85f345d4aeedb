"""Where the scheduler's time goes: cumulative wall seconds and counts per phase of `Scheduler.step`.

The phases, in step order (scheduler.py's docstring):
- admit: drop cancelled and expired requests, pick the joiners;
- prefill: `Batch.prefill` (the prompts' forward);
- decode: `Batch.decode` (one forward for every running row; in a mixed step, prefill.py, the
  joiners' prompts ride in it);
- sample: `Batch.sample` (after a prefill and after a decode);
- emit: `Batch.emit` (stop checks, detokenizing, events);
- deliver: pushing the events to their requests;
- evict: rows leaving or joining the batch (`filter` / `concatenate`).

Phases may nest (admit evicts the cancelled rows; a prefill's retry merges batches): each second
counts once, for the innermost phase open, so the seconds add up to the time spent in phases.
The cost is two `perf_counter` calls per phase entered, none per row.

On a GPU the host only queues kernels: without a sync, a phase's seconds would be the time to queue
its work, and the GPU's time would show up in whichever later phase first reads a result (emit).
So a clock made for a CUDA device (`for_device`) synchronizes the device at each phase boundary.
That is one more host sync per boundary (about seven a step), the price of true per-phase times;
a clock for any other device waits for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ADMIT, PREFILL, DECODE, SAMPLE, EMIT, DELIVER, EVICT = PHASES = (
    "admit", "prefill", "decode", "sample", "emit", "deliver", "evict")


@dataclass(frozen=True)
class PhaseTimes:
    """A snapshot: per phase (every name in PHASES), wall seconds spent and times entered."""

    seconds: dict[str, float]
    counts: dict[str, int]


class PhaseClock:
    """Accumulates PhaseTimes on the one thread that runs the steps; `snapshot` may be read from any.
    `sync`, when given, is called before each reading of the clock (a CUDA device's synchronize)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None):
        self._now = now
        self._sync = sync
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._counts = dict.fromkeys(PHASES, 0)
        self._open: list[str] = []  # the phases entered and not left, innermost last
        self._since = 0.0  # when the innermost open phase last started counting

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Count the time inside the block for `phase`, except the time of phases nested in it;
        an exception leaving the block still counts."""
        self._switch()
        self._open.append(phase)
        self._counts[phase] += 1
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def _switch(self) -> None:
        """Charge the time since the last switch to the innermost open phase."""
        if self._sync is not None:
            self._sync()
        now = self._now()
        if self._open:
            self._seconds[self._open[-1]] += now - self._since
        self._since = now

    def snapshot(self) -> PhaseTimes:
        # dict() of a dict whose keys never change is safe to take while the step thread writes.
        return PhaseTimes(dict(self._seconds), dict(self._counts))


def for_device(device) -> PhaseClock:
    """A clock for steps running on `device`: one that synchronizes at phase boundaries on CUDA."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return PhaseClock()
    return PhaseClock(sync=lambda: torch.cuda.synchronize(device))
