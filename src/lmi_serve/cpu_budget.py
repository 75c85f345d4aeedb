"""How many CPU threads the server may keep busy: the smallest of what the machine and the user allow.

    affinity            the CPUs the process may run on (sched_getaffinity: taskset, cpusets, Docker --cpuset-cpus)
    cgroup v2 cpu.max   quota / period ("250000 100000": 2.5 CPUs; "max": none)   at every level up from its own
    cgroup v1 quota     cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)            cgroup (lmi_serve/cgroup.py)
    requested           option.cpu_threads, else OMP_NUM_THREADS (its first level: "4,2" is 4)

A fractional quota is rounded down, to at least 1: quota-many threads spend the quota as fast as the CPUs
allow, and one thread more spends it before the period ends, so the kernel stops every thread until the
next period (CFS throttling), and torch's threads wait at each op's barrier for the stopped ones. The
fraction left is the request threads', the tokenizer's and the HTTP layer's. The budget is the whole
server's: each of its worker processes gets an equal share (`per_worker`), at least one thread.

Stdlib only: the launcher logs the budget once before torch is imported (__main__.py), and each worker
reads the same inputs again to size its torch threads (server/app.py) and show them (GET /models/<m>).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lmi_serve import cgroup


@dataclass(frozen=True)
class Limit:
    """What one source allows: `cpus` (a quota may be fractional), named `source`, read from `detail`."""

    source: str
    cpus: float
    detail: str = ""

    @property
    def threads(self) -> int:
        return max(1, math.floor(self.cpus))

    def describe(self) -> str:
        return f"{self.source} {self.cpus:g}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class CpuBudget:
    """The server's threads, the limit that decided them, and every limit found (for the log)."""

    threads: int
    decided_by: Limit
    limits: tuple[Limit, ...]
    ignored: tuple[str, ...] = ()  # settings that were not numbers of threads, and why they were passed over

    @property
    def source(self) -> str:
        return self.decided_by.source

    def per_worker(self, workers: int) -> int:
        return max(1, self.threads // max(1, workers))

    def describe(self, workers: int) -> str:
        """The start-up log line."""
        others = [limit.describe() for limit in self.limits if limit is not self.decided_by]
        line = (f"CPU budget: {self.threads} thread(s), from {self.decided_by.describe()}"
                f"{'; also ' + ', '.join(others) if others else ''}; "
                f"{workers} worker(s): {self.per_worker(workers)} torch thread(s) each")
        return line + "".join(f"; ignored {note}" for note in self.ignored)

    def as_json(self, workers: int) -> dict:
        """For GET /models/<m>: the number, where it came from, and this worker's share."""
        return {"threads": self.threads, "source": self.source, "detail": self.decided_by.detail,
                "workers": workers, "threadsPerWorker": self.per_worker(workers),
                "limits": [{"source": limit.source, "cpus": limit.cpus} for limit in self.limits]}


def cpu_budget(cpu_threads: int | None, env: Mapping[str, str], root: Path = cgroup.ROOT,
               affinity: int | None = None) -> CpuBudget:
    """The budget from option.cpu_threads (`cpu_threads`, None: unset), the environment's OMP_NUM_THREADS,
    the cgroups under `root` and the affinity mask (`affinity`: its CPU count; None: this process's)."""
    requested, ignored = _requested(cpu_threads, env)
    limits = [*requested, *cpu_quotas(root), Limit("affinity", affinity or _affinity(), "CPUs the process may run on")]
    decided = min(limits, key=lambda limit: limit.threads)  # ties: the first, the user's setting before the machine's
    return CpuBudget(decided.threads, decided, tuple(limits), tuple(ignored))


def cpu_quotas(root: Path = cgroup.ROOT) -> list[Limit]:
    """Every CFS quota on this process's cgroups (v2, then v1; innermost first); none where unlimited."""
    quotas = []
    for folder in cgroup.folders("cpu", root):
        quota = _v2_quota(folder.path) if folder.version == 2 else _v1_quota(folder.path)
        if quota is not None:
            quotas.append(quota)
    return quotas


def _v2_quota(folder: Path) -> Limit | None:
    text = cgroup.read(folder / "cpu.max")  # "<quota> <period>" in µs, or "max <period>"
    words = (text or "").split()
    if len(words) != 2 or not words[0].isdigit() or not words[1].isdigit() or int(words[1]) == 0:
        return None
    return Limit("cgroup v2 cpu.max", int(words[0]) / int(words[1]), f"{folder / 'cpu.max'}: {text}")


def _v1_quota(folder: Path) -> Limit | None:
    quota = cgroup.read(folder / "cpu.cfs_quota_us")  # -1: no quota
    period = cgroup.read(folder / "cpu.cfs_period_us") or "100000"  # the kernel's default period
    if not quota or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return Limit("cgroup v1 cpu.cfs_quota_us", int(quota) / int(period),
                 f"{folder / 'cpu.cfs_quota_us'}: {quota} / {period}")


def _requested(cpu_threads: int | None, env: Mapping[str, str]) -> tuple[list[Limit], list[str]]:
    """The user's number, if any: option.cpu_threads (validated with the configuration), else OMP_NUM_THREADS."""
    if cpu_threads is not None:
        return [Limit("option.cpu_threads", cpu_threads)], []
    text = env.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return [], []
    first = text.split(",")[0].strip()  # OpenMP's list gives each nesting level its own count
    if not first.isdigit() or int(first) < 1:
        return [], [f"OMP_NUM_THREADS={text!r} (not a number of threads)"]
    return [Limit("OMP_NUM_THREADS", int(first))], []


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
