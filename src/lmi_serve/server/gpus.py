"""Which GPUs each gunicorn worker takes: its own, never another worker's.

The rule (`plan_gpus`, checked by the launcher before gunicorn starts): each worker gets a group of
`per_worker` GPUs, and the worker in slot i takes the visible GPUs i*per_worker .. (i+1)*per_worker-1:

- `per_worker` is the largest `option.tensor_parallel_degree` among the models (`max`: every GPU),
  at least 1: a model's tensor-parallel rank r computes on the group's GPU r;
- a model with `option.device_map` (accelerate spreading its layers) spreads over an equal share of
  the GPUs instead, `gpus // workers`, when that is more;
- workers × per_worker more than the visible GPUs is a start-up error naming the options.

How a worker gets its group: the arbiter gives each worker a slot before it forks it (`assign_slot`,
gunicorn's `pre_fork`): the lowest slot no live worker holds, so a worker that replaces a dead one
takes the dead one's slot and GPUs. Right after the fork, before the worker imports torch (`enter_slot`,
`post_fork`), the worker sets `LMI_SERVE_WORKER_SLOT` and `CUDA_VISIBLE_DEVICES` to its group's GPUs.
CUDA then numbers them from 0 in the worker and in the tensor-parallel followers it starts (they inherit
its environment): `cuda:0` is the group's first GPU, rank r's `cuda:r` is GPU i*per_worker + r, and
accelerate's `device_map=auto` sees the group only. With no GPU nothing is set but the slot.

Counting (`count_gpus`): the launcher must not initialise CUDA (a worker forked after that could not use
it) and does not import torch (it stays light; the workers import it after the fork). It asks a child
Python for `torch.cuda.device_count()` (what the workers will see: it honours CUDA_VISIBLE_DEVICES), and
only where a GPU driver's device node exists: a machine without one has no GPU, and pays no child.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lmi_serve.config.models import ConfigError, ServerConfig

log = logging.getLogger(__name__)

SLOT_ENV = "LMI_SERVE_WORKER_SLOT"
DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # NVIDIA's driver, ROCm's
COUNT_SECONDS = 120.0  # importing torch in the child; a CUDA driver that hangs longer is no driver to use
_COUNT = "import torch; print(torch.cuda.device_count())"
WORKERS_KEYS = "--workers, SAGEMAKER_NUM_MODEL_WORKERS or SERVING_MAX_WORKERS"


def count_gpus(env: Mapping[str, str], *, nodes: Iterable[str] = DRIVER_NODES, run: Any = subprocess.run) -> int | None:
    """The GPUs the workers will see, counted without initialising CUDA here; 0 where no GPU driver's
    device node exists; None (logged) when the count failed."""
    if not any(os.path.exists(node) for node in nodes):
        return 0
    try:
        done = run([sys.executable, "-c", _COUNT], env=dict(env), capture_output=True, text=True,
                   timeout=COUNT_SECONDS, check=True)
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("Could not count the GPUs (%s): the workers are given no GPUs of their own, and each "
                    "places its models on the GPUs it sees", str(detail).strip().splitlines()[-1:] or exc)
        return None


@dataclass(frozen=True)
class GpuPlan:
    """The workers' GPUs: `per_worker` of `visible` (CUDA_VISIBLE_DEVICES entries, or ordinals) each."""

    workers: int
    per_worker: int = 0  # 0: no GPU (or not counted): nothing to place
    visible: tuple[str, ...] = ()
    why: str = ""

    def devices(self, slot: int) -> tuple[str, ...]:
        """The CUDA_VISIBLE_DEVICES entries of the worker in `slot`."""
        return self.visible[slot * self.per_worker:(slot + 1) * self.per_worker]

    def worker_env(self, slot: int) -> dict[str, str]:
        env = {SLOT_ENV: str(slot)}
        if self.per_worker:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices(slot))
        return env

    def describe(self) -> str:
        if not self.per_worker:
            return f"GPUs: none; {self.workers} worker(s) on the CPU"
        groups = "; ".join(f"worker {slot}: {','.join(self.devices(slot))}" for slot in range(self.workers))
        return (f"GPUs: {len(self.visible)} visible, {self.per_worker} per worker ({self.why}): {groups} "
                "(CUDA_VISIBLE_DEVICES numbering)")


def _visible(env: Mapping[str, str], gpus: int) -> tuple[str, ...]:
    """The entries that name the `gpus` devices torch counted, in CUDA's order: CUDA_VISIBLE_DEVICES's
    (ordinals or UUIDs) when set, so a worker's subset keeps the user's choice; else 0..gpus-1."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return tuple(str(i) for i in range(gpus))
    return tuple(entry.strip() for entry in listed.split(","))[:gpus]


def plan_gpus(config: ServerConfig, gpus: int | None, env: Mapping[str, str],
              workers_key: str = "workers") -> GpuPlan:
    """Each worker's GPUs for `config` on `gpus` visible GPUs (0 or None: none); ConfigError, starting
    with `workers_key` (how the user set the workers), when the workers need more GPUs than there are."""
    workers = config.workers
    if not gpus:
        return GpuPlan(workers)
    degrees = [(gpus if m.tensor_parallel_degree == "max" else m.tensor_parallel_degree, m.name)
               for m in config.models]
    degree, model = max(degrees, key=lambda d: d[0])
    per_worker, why = max(degree, 1), (f"option.tensor_parallel_degree={degree}, model {model}" if degree > 1
                                       else "one per worker")
    spread = [m.name for m in config.models if m.device_map not in (None, "cpu")]
    if spread and gpus // workers > per_worker:
        per_worker, why = gpus // workers, f"an equal share for option.device_map, model {spread[0]}"
    need = workers * per_worker
    if need > gpus:
        if workers == 1:  # only a degree can ask for more GPUs than there are
            workers_key = "option.tensor_parallel_degree"
            what = f"option.tensor_parallel_degree={degree} (model {model}) needs {degree} GPUs"
        elif any(m.tensor_parallel_degree == "max" for m in config.models) and degree == gpus:
            what = f"option.tensor_parallel_degree=max (model {model}) gives every GPU to one worker"
        elif degree > 1:
            what = (f"{workers} workers × option.tensor_parallel_degree={degree} (model {model}) need {need} GPUs, "
                    f"a group of {degree} per worker")
        else:
            what = f"{workers} workers need {need} GPUs, one per worker"
        raise ConfigError(
            f"{workers_key}: {what}, and {gpus} {'is' if gpus == 1 else 'are'} visible: each worker takes GPUs "
            f"of its own (its own group of option.tensor_parallel_degree GPUs with tensor parallelism). Lower "
            f"the workers ({WORKERS_KEYS}) or option.tensor_parallel_degree (OPTION_TENSOR_PARALLEL_DEGREE, "
            f"TENSOR_PARALLEL_DEGREE, SM_NUM_GPUS), or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return GpuPlan(workers, per_worker, _visible(env, gpus), why)


def pick_slot(workers: int, held: Iterable[tuple[int, int]]) -> int:
    """The slot for a worker about to start, given the live workers' (slot, age): the lowest free slot
    (a replacement takes the dead worker's). Only while gunicorn runs more workers than configured (a
    reload starts the new ones before it ends the old, oldest first) is none free: then the slot whose
    oldest holder is oldest, the one gunicorn ends first."""
    holders: dict[int, list[int]] = {slot: [] for slot in range(workers)}
    for slot, age in held:
        holders.setdefault(slot, []).append(age)
    return min(range(workers), key=lambda slot: (len(holders[slot]), min(holders[slot], default=0), slot))


def assign_slot(server: Any, worker: Any, plan: GpuPlan) -> None:
    """gunicorn's pre_fork (in the arbiter): give `worker` its slot; the forked worker inherits it."""
    held = [(w.lmi_slot, w.age) for w in server.WORKERS.values() if getattr(w, "lmi_slot", None) is not None]
    worker.lmi_slot = pick_slot(plan.workers, held)


def enter_slot(worker: Any, plan: GpuPlan, environ: dict[str, str] | Any = None) -> dict[str, str]:
    """gunicorn's post_fork (in the new worker, before it imports torch): take the slot's GPUs."""
    slot = getattr(worker, "lmi_slot", 0)
    env = plan.worker_env(slot)
    (os.environ if environ is None else environ).update(env)
    if plan.per_worker:
        log.info("Worker %s (slot %d) takes GPU(s) %s", worker.pid, slot, env["CUDA_VISIBLE_DEVICES"])
    return env
