"""Tensor parallelism (`option.tensor_parallel_degree`): the ranks of one model replica.

transformers shards the model by its tensor-parallel plan (`base_model_tp_plan`: attention heads and
MLP columns split, an all-reduce after each row-wise layer) over a torch.distributed process group.
lmi-serve runs that group inside each model replica, torchrun-style, one process per device:

- rank 0 is the server's worker process: it starts ranks 1..N-1 (`start_followers`: `python -m
  lmi_serve.server.tp_follower`, the model's config as JSON on stdin), joins the group, loads its
  shard and runs the scheduler, the sampler and everything HTTP-facing;
- the followers load their shards and replay rank 0's model calls (engine/kv/replicate.py).

Backends: gloo on CPU (each rank gets the worker's torch threads // N, at least 1), NCCL on GPUs (rank r
on `cuda:r`, the worker's GPU r: server/gpus.py gives each worker its own; that branch has not run on a
GPU yet). Every collective has `GROUP_TIMEOUT`, and rank 0 watches its followers' processes: a rank that
dies fails the model (`TPGroup.fail`), never hangs it.

Failing fast differs by backend. With gloo a collective whose peer died raises at once (the socket
closes), so the step's own error fails the group too. With NCCL it does not: the collective's kernel
waits on the GPU for a peer that never comes, and the thread that next reads a result (the scheduler's)
waits with it, until the watchdog's `GROUP_TIMEOUT`, when torch by default tears the whole worker down.
So on NCCL (`nccl_environment`, `TPGroup.abort`):
- rank 0's watch thread, which reads process states and waits on no collective, fails the group when a
  follower exits (the model turns Failed at once), then ends the other followers and aborts rank 0's
  communicators (`abort_group`), so the kernels waiting on the dead peer return and the scheduler's
  thread gets an error instead of waiting;
- rank 0 runs with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (on a collective's error or timeout the watchdog
  aborts the communicators and keeps the process): a rank that hangs without dying fails the model at
  the timeout, with /ping answering Failed, rather than killing the worker;
- the followers run with 3 (the watchdog ends the process without `ncclCommAbort`, which can hang on a
  dead peer), and each leaves at once when rank 0, its parent, is gone (`watch_parent`);
- TORCH_NCCL_BLOCKING_WAIT stays 0: it would make every all-reduce (two per layer) wait on the host.
Variables the user set are kept.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmi_serve.model.source import ModelLoadError

log = logging.getLogger(__name__)

# A collective waiting longer than this raises: loading a large model's shards (rank skew) must fit,
# and rank 0 sends a heartbeat well within it while idle (engine/kv/replicate.py).
GROUP_TIMEOUT = datetime.timedelta(seconds=180)
WATCH_SECONDS = 0.5  # how often rank 0 looks at its followers' processes


class TensorParallelError(ModelLoadError):
    """The model cannot run with the tensor_parallel_degree asked for; the message says what to do."""


def resolve_degree(degree: int | str, gpus: int) -> int:
    """`max` (or -1) is every visible GPU; a CPU is one device, so `max` there is 1 rank."""
    if degree in ("max", -1):
        return max(gpus, 1)
    return int(degree)


def check_tp_plan(config: Any, degree: int) -> None:
    """Raise TensorParallelError unless transformers can shard a model of `config` over `degree` ranks:
    it needs a tensor-parallel plan (`base_model_tp_plan`) and head counts `degree` divides (a rank
    holds whole heads; a query head must find its key/value head on the same rank)."""
    if degree <= 1:
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", type(config).__name__)
    if not getattr(text, "base_model_tp_plan", None):
        raise TensorParallelError(
            f"option.tensor_parallel_degree={degree}: transformers has no tensor-parallel plan for {model_type} "
            "models; use tensor_parallel_degree=1, or option.device_map=auto to spread its layers over GPUs")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % degree:
            raise TensorParallelError(
                f"option.tensor_parallel_degree={degree}: this {model_type} model has {count} {name}, which "
                f"{degree} ranks cannot split evenly; choose a degree that divides {heads} and {kv_heads}, or "
                "use option.device_map=auto")


def threads_per_rank(world: int, cores: int) -> int:
    """CPU threads each rank's torch gets: the replica's cores shared out, at least one."""
    return max(1, cores // world)


def free_port() -> int:
    """A TCP port free on the loopback now, for the group's rendezvous (each replica its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_SET_HERE: set[str] = set()  # the nccl_environment variables this process set (not the user): not inherited


def nccl_environment(rank: int) -> dict[str, str]:
    """The NCCL error handling each rank starts with (the module's docstring says why), unless set."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2" if rank == 0 else "3", "TORCH_NCCL_BLOCKING_WAIT": "0"}


def abort_group() -> None:
    """End this rank's NCCL communicators now: collectives waiting on a dead peer return (with an
    error on the next one) instead of waiting for the watchdog."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)  # torch >= 2.6; experimental, NCCL only
    if abort is not None:
        abort()
    else:
        distributed_c10d.destroy_process_group()


def watch_parent(parent: int, *, leave: Callable[[int], Any] = os._exit, getppid: Callable[[], int] = os.getppid,
                 every: float = WATCH_SECONDS, stop: threading.Event | None = None) -> threading.Thread:
    """A follower: start a daemon thread that ends this process (`leave(1)`) once rank 0, its parent
    `parent`, is gone, whatever this rank's collectives are waiting on."""
    stop = stop or threading.Event()

    def watch() -> None:
        while not stop.wait(every):
            if getppid() != parent:
                log.error("Rank 0 (pid %d) is gone: this rank leaves the tensor-parallel group", parent)
                leave(1)
                return

    thread = threading.Thread(target=watch, name="tp-parent-watch", daemon=True)
    thread.start()
    return thread


def join_group(rank: int, world: int, port: int, threads: int) -> Any:
    """Join the replica's process group (gloo on CPU, NCCL with GPUs); on a CPU this rank's torch
    uses `threads` threads. Returns the device this rank computes on."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        device = torch.device("cuda", rank)  # NCCL: written to the docs, not yet run on a GPU here
        torch.cuda.set_device(device)
        backend = "nccl"
        for key, value in nccl_environment(rank).items():  # read when the communicators are made
            if key not in os.environ:
                os.environ[key] = value
                _SET_HERE.add(key)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(threads)
    # transformers reads these when it builds the device mesh
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    log.info("Tensor parallel: rank %d of %d joined (%s, %s, %d threads)", rank, world, backend, device,
             torch.get_num_threads())
    return device


@dataclass
class TPGroup:
    """Rank 0's view of its replica's group: the follower processes, and who to tell when it breaks."""

    world: int
    port: int
    followers: list[subprocess.Popen] = field(default_factory=list)
    failure: str | None = None
    # NCCL: ends rank 0's communicators when the group fails (abort_group); None on gloo, whose
    # collectives raise by themselves when a peer dies
    abort: Callable[[], None] | None = None
    _listeners: list[Callable[[str], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once when the group breaks (at once if it already has)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def fail(self, reason: str) -> None:
        """The group is broken (a rank died, a replicated call raised): the model cannot go on."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners, self._listeners = self._listeners, []
        log.error("Tensor parallel group failed: %s", reason)
        if self.abort is not None:  # on a thread: an abort may itself wait on the dead peer
            threading.Thread(target=self._abort, name="tp-abort", daemon=True).start()
        for listener in listeners:
            listener(reason)

    def _abort(self) -> None:
        """NCCL: end the followers still running (nothing is left for them to do, and their GPUs are
        freed), then rank 0's communicators, so whatever waits on a collective gets an error now."""
        for process in self.followers:
            if process.poll() is None:
                process.kill()
        try:
            self.abort()
        except Exception:
            log.exception("Tensor parallel: aborting the NCCL communicators failed")
        else:
            log.info("Tensor parallel: NCCL communicators aborted")

    def watch(self) -> None:
        """Start a daemon thread that fails the group when a follower process exits."""
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        stop = threading.Event()
        while self.failure is None and not stop.wait(WATCH_SECONDS):
            for rank, process in enumerate(self.followers, start=1):
                code = process.poll()
                if code is not None:
                    self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with status {code}")
                    break

    def stop(self, tell: Callable[[], None] | None = None, wait: float = 5.0) -> None:
        """End the followers (the worker is exiting, or loading failed): `tell()` asks them to leave
        (Replicator.stop); those still running `wait` seconds later are killed (they ignore SIGTERM,
        tp_follower.py). Their exits are no failure."""
        with self._lock:
            self.failure = self.failure or "stopped"
            self._listeners = []
        if tell is not None:
            tell()
        for process in self.followers:
            try:
                process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_followers(config_json: str, cache_dir: str, world: int, threads: int) -> TPGroup:
    """Start ranks 1..world-1 of a new group (each reads `config_json`, a ModelConfig, on stdin) and
    return it; rank 0 (the caller) joins next with `join_group(0, world, group.port, threads)`."""
    group = TPGroup(world=world, port=free_port())
    # A rank 0 that joined a group before (another model of the worker) set its own NCCL handling: each
    # follower sets its own (nccl_environment); the user's settings pass on.
    env = {key: value for key, value in os.environ.items() if key not in _SET_HERE}
    for rank in range(1, world):
        process = subprocess.Popen(
            [sys.executable, "-m", "lmi_serve.server.tp_follower", "--rank", str(rank), "--world", str(world),
             "--port", str(group.port), "--threads", str(threads), "--cache-dir", cache_dir],
            stdin=subprocess.PIPE, text=True, env=env)
        process.stdin.write(config_json)
        process.stdin.close()
        group.followers.append(process)
    log.info("Tensor parallel: started %d follower rank(s), pids %s, rendezvous port %d", world - 1,
             [p.pid for p in group.followers], group.port)
    return group


def start_group(config_json: str, cache_dir: str, world: int) -> tuple[TPGroup, Any]:
    """Rank 0: start the followers, join the group with them and watch them. Returns the group and
    rank 0's device; the followers are ended if joining fails. The worker's torch threads (its share
    of the CPU budget, cpu_budget.py via app.configure_threads) are shared out among the ranks."""
    import torch

    threads = threads_per_rank(world, torch.get_num_threads())
    group = start_followers(config_json, cache_dir, world, threads)
    try:
        device = join_group(0, world, group.port, threads)
    except BaseException:
        group.stop()
        raise
    if device.type == "cuda":
        group.abort = abort_group
    group.watch()
    return group, device
