"""Engine replicas on a many-core CPU: N worker processes, each pinned to its own contiguous slice of the CPUs.

One engine's torch threads stop scaling long before a large box's cores run out (each op waits for its slowest
thread, and a small model's matmuls are too small to split 16 ways), so `option.engine_replicas` runs several
engines, gunicorn workers behind the one port, each with an equal share of the CPU budget (cpu_budget.py) and
its own cores:

- **How many** (`plan_replicas`, in the launcher before gunicorn starts): an integer is taken as it is; `auto`
  is one replica per `CORES_PER_AUTO_REPLICA` threads of the budget, at least one (1 up to 15 threads, 2 at
  16, 8 at 64), and 1 where one worker is required (a multi-model endpoint, LoRA adapters) or GPUs do the
  work. Never more replicas than the budget has threads: a replica needs a thread, and a core of its own.
- **Which cores** (`split_cores`): the affinity mask's CPUs in order, cut into contiguous, disjoint slices of
  as equal a size as they allow (neighbouring CPU numbers mostly share a core complex and its cache). Each
  replica runs budget ÷ replicas torch threads on its slice.
- **Entering** (`enter_core_set`, gunicorn's `post_fork`: in the new worker, before it imports torch): the
  worker pins itself (`sched_setaffinity`, which every thread it starts inherits: torch's OpenMP pool sizes
  itself from it) and reads the layout from LAYOUT_ENV later (`worker_layout`: server/app.py sizes torch by
  it and GET /models/<m> shows it). A replacement worker takes the dead one's slot (gpus.py), so its cores.
- **Memory**: each replica loads its own model from the memory-mapped safetensors cache; the row kernel's
  `auto` makes its copies only where every replica's fit a quarter of the memory available (REPLICAS_ENV).

Unset, the workers (SAGEMAKER_NUM_MODEL_WORKERS) run unpinned as before. Stdlib only: the launcher imports it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmi_serve.config.models import ConfigError, ServerConfig
from lmi_serve.cpu_budget import CpuBudget

log = logging.getLogger(__name__)

CORES_PER_AUTO_REPLICA = 8
LAYOUT_ENV = "LMI_SERVE_REPLICA_LAYOUT"  # the layout as JSON, set in each pinned worker
REPLICAS_ENV = "LMI_SERVE_REPLICAS"  # kernels/cpu/row_kernel.py's name for it (kernels import no server module)
KEY = "option.engine_replicas"


@dataclass(frozen=True)
class ReplicaLayout:
    """`replicas` workers of `threads` torch threads each; `core_sets[i]`: slot i's CPUs (empty: unpinned)."""

    replicas: int
    threads: int
    core_sets: tuple[tuple[int, ...], ...] = ()
    why: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.core_sets)

    @property
    def cpus(self) -> int:
        """The CPUs of every slice together: the affinity the budget was read from."""
        return sum(len(cores) for cores in self.core_sets)

    def describe(self) -> str:
        if not self.pinned:
            return f"Engine replicas: {self.replicas} worker(s), not pinned ({self.why})"
        slices = "; ".join(f"replica {slot}: CPUs {cpu_list(cores)}" for slot, cores in enumerate(self.core_sets))
        return (f"Engine replicas: {self.replicas} ({self.why}), {self.threads} torch thread(s) each, "
                f"pinned: {slices}")

    def to_env(self) -> str:
        return json.dumps({"threads": self.threads, "coreSets": self.core_sets, "why": self.why})

    @classmethod
    def from_env(cls, text: str) -> ReplicaLayout:
        data = json.loads(text)
        sets = tuple(tuple(cores) for cores in data["coreSets"])
        return cls(len(sets), data["threads"], sets, data["why"])

    def as_json(self, slot: int) -> dict[str, Any]:
        """For GET /models/<m>'s cpuThreads: the layout and the answering worker's cores."""
        return {"replicas": self.replicas, "replicaLayout": self.why,
                "coreSet": list(self.core_sets[slot]) if slot < len(self.core_sets) else None}


def cpu_list(cores: Sequence[int]) -> str:
    """`0-3,8`: the kernel's cpulist spelling."""
    runs: list[list[int]] = []
    for cpu in cores:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def auto_replicas(threads: int) -> int:
    """`auto`'s count for a budget of `threads`: one replica per CORES_PER_AUTO_REPLICA threads, at least one."""
    return max(1, threads // CORES_PER_AUTO_REPLICA)


def split_cores(cpus: Sequence[int], replicas: int) -> tuple[tuple[int, ...], ...]:
    """`cpus` (sorted) cut into `replicas` contiguous, disjoint slices, the first ones a CPU longer where
    they do not divide evenly; ValueError when there are fewer CPUs than replicas."""
    cpus = sorted(cpus)
    if replicas < 1 or len(cpus) < replicas:
        raise ValueError(f"{len(cpus)} CPU(s) cannot give {replicas} replica(s) a CPU each")
    size, extra = divmod(len(cpus), replicas)
    slices, start = [], 0
    for slot in range(replicas):
        end = start + size + (1 if slot < extra else 0)
        slices.append(tuple(cpus[start:end]))
        start = end
    return tuple(slices)


def plan_replicas(config: ServerConfig, budget: CpuBudget, cpus: Sequence[int], *, gpus: int = 0,
                  workers_key: str | None = None) -> ReplicaLayout:
    """The workers and their cores for `config.engine_replicas` on a budget of `budget.threads` over the
    affinity mask `cpus`. `workers_key`: the variable that set the workers, where one did (it must agree with
    an explicit number, and leaves `auto` nothing to choose). ConfigError naming the key otherwise."""
    setting = config.engine_replicas
    if setting is None:
        return ReplicaLayout(config.workers, budget.per_worker(config.workers), (), "option.engine_replicas unset")
    if workers_key is not None and (setting == "auto" or setting != config.workers):
        raise ConfigError(f"{KEY}: {setting} and {workers_key}={config.workers} both set the workers; set one")
    single = _single_worker_reason(config)
    if setting == "auto":
        if single or gpus:
            return ReplicaLayout(1, budget.threads, (), f"auto: 1, {single or 'the GPUs do the work'}")
        replicas = auto_replicas(budget.threads)
        why = f"auto: {budget.threads} thread(s) of budget / {CORES_PER_AUTO_REPLICA} per replica"
    else:
        replicas, why = setting, f"{KEY}={setting}"
        if single and replicas > 1:
            raise ConfigError(f"{KEY}: {replicas} replicas, but {single}")
    if replicas > budget.threads:
        raise ConfigError(f"{KEY}: {replicas} replicas need a CPU thread each, and the CPU budget is "
                          f"{budget.threads} (from {budget.decided_by.describe()}); lower it or use auto")
    return ReplicaLayout(replicas, budget.threads // replicas, split_cores(cpus, replicas), why)


def _single_worker_reason(config: ServerConfig) -> str:
    if config.multi_model:
        return "a multi-model endpoint needs a single worker"
    lora = [m.name for m in config.models if m.enable_lora]
    return f"option.enable_lora (model {lora[0]}) needs a single worker" if lora else ""


def enter_core_set(worker: Any, layout: ReplicaLayout, environ: dict[str, str] | Any = None) -> tuple[int, ...]:
    """gunicorn's post_fork (in the new worker, before it imports torch): pin this process to its slot's
    CPUs and leave the layout for the app; nothing when the layout is not pinned."""
    if not layout.pinned:
        return ()
    slot = getattr(worker, "lmi_slot", 0)
    cores = layout.core_sets[slot]
    os.sched_setaffinity(0, cores)
    env = os.environ if environ is None else environ
    env[LAYOUT_ENV] = layout.to_env()
    env[REPLICAS_ENV] = str(layout.replicas)  # the row kernel's `auto` counts every replica's copies
    log.info("Worker %s (slot %d) pinned to CPUs %s, %d torch thread(s)", worker.pid, slot, cpu_list(cores),
             layout.threads)
    return cores


def worker_layout(env: Mapping[str, str]) -> ReplicaLayout | None:
    """This worker's layout when it was pinned (enter_core_set), else None."""
    text = env.get(LAYOUT_ENV)
    return ReplicaLayout.from_env(text) if text else None
