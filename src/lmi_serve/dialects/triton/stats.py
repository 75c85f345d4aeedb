"""Inference statistics per model, in the shape of Triton's statistics extension.

Counted in this worker process (each gunicorn worker keeps its own), for requests on the Triton
routes. Time is measured around the model call, so `compute_infer` includes any queueing in front
of the model; the other phase counters stay zero because this server does not time them apart.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

_PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
           "cache_miss")


@dataclass
class ModelCounters:
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    phases: dict[str, list[int]] = field(default_factory=lambda: {p: [0, 0] for p in _PHASES})  # [count, ns]


class StatsBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelCounters] = {}

    def record(self, model: str, *, success: bool, elapsed_ns: int) -> None:
        with self._lock:
            counters = self._models.setdefault(model, ModelCounters())
            counters.last_inference_ms = int(time.time() * 1000)
            outcome = counters.phases["success" if success else "fail"]
            outcome[0] += 1
            outcome[1] += elapsed_ns
            if success:
                counters.inference_count += 1
                counters.execution_count += 1
                counters.phases["compute_infer"][0] += 1
                counters.phases["compute_infer"][1] += elapsed_ns

    def model_stats(self, model: str, version: str) -> dict:
        with self._lock:
            counters = self._models.get(model, ModelCounters())
            return {
                "name": model, "version": version, "last_inference": counters.last_inference_ms,
                "inference_count": counters.inference_count, "execution_count": counters.execution_count,
                "inference_stats": {p: {"count": c, "ns": ns} for p, (c, ns) in counters.phases.items()},
                "response_stats": {}, "batch_stats": [], "memory_usage": [],
            }


class Timer:
    """`with book.timed(model) as t: ...`: records success unless the block raised."""

    def __init__(self, book: StatsBook, model: str):
        self.book, self.model = book, model

    def __enter__(self) -> "Timer":
        self.started = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.book.record(self.model, success=exc_type is None, elapsed_ns=time.perf_counter_ns() - self.started)
