"""Tensor parallelism at the KV seam: rank 0's model calls, replayed by the other ranks.

With the model sharded over N ranks (model/tp.py), every forward is a collective: each rank must run
the same forward, with the same inputs, against its own shard and its own shard of the KV cache. The
narrowest place where the engine calls the model is the KV seam (kv/protocol.py): a `KVLayout` prefill and
the `KVBatch` operations `feed` / `decode` / `keep` / `extend` / `prefill_more`. Everything else
(scheduling, sampling, stop checks, detokenizing) only reads the logits, which are whole on every
rank after the sharded lm_head's gather.

So `Replicator` wraps rank 0's layout: before each operation it broadcasts a small description
(`Op`: which batch, which operation, its token ids or row indices) with `broadcast_object_list`,
then runs it locally. `follow` is the other ranks' loop: receive an op, apply it to the same batch
of their own. The scheduler, the batch and the sampler neither know nor care: they get a KV layout
that declares what the wrapped one does, as with any other. Followers do not replay the scheduler itself: that would make every rank
see the same requests, deadlines and cancellations at the same step, which is far more to keep in
step than the handful of KV operations.

Ordering: every op goes out and runs under one lock, so the ranks see the ops, and so the forwards'
collectives, in one order whichever thread calls (the scheduler's, the warm-up, a dynamic batch).
A `KVBatch` rank 0 lets go of is dropped on the followers with the next op. While idle, rank 0 sends
a no-op every `HEARTBEAT_SECONDS`, so a follower's wait never reaches the group's timeout.

Failure: an exception in a replicated op (a collective timing out or a peer gone, or one rank's op
failing alone) leaves the ranks out of step, so it fails the whole group (`on_error`): the model is
marked failed instead of running on with mismatched shards.

Not replicated, so refused with tensor parallelism (config/sources.py): prefix caching (`row_kv` / `resume`
hand rank 0's shard of K/V to a cache), LoRA and option.quantize (they rewrite rank 0's layers).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lmi_serve.engine.kv.protocol import KVBatch, KVLayout, Prefilled, eviction_order, held_bytes

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0

PREFILL, FEED, DECODE, KEEP, EXTEND, PREFILL_MORE, NOOP, STOP = (
    "prefill", "feed", "decode", "keep", "extend", "prefill_more", "noop", "stop")


@dataclass(frozen=True)
class Op:
    """One model-facing operation, as the followers replay it."""

    kind: str
    batch: int = -1  # the batch it applies to (PREFILL: the id of the new one)
    ids: tuple[int, ...] | tuple[tuple[int, ...], ...] = ()  # tokens (FEED, PREFILL_MORE), prompts, rows (KEEP)
    other: int = -1  # EXTEND: the batch appended (spent)
    pad_id: int = 0
    prompt_logits: bool = False
    dropped: tuple[int, ...] = ()  # batches rank 0 let go of since the last op


def broadcast(op: Op | None) -> Op:
    """Rank 0 sends `op`; the others receive it (pass None). One collective for every rank."""
    import torch.distributed as dist

    box = [op]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Replicator(KVLayout):
    """Rank 0's side: the KV layout `inner`, whose batches run on every rank of the group. It declares
    what `inner` does, except prefix reuse: `resume` and `row_kv` are not replicated (a row resumed on
    rank 0 alone would leave the ranks out of step), and config/sources.py refuses prefix caching with
    tensor parallelism."""

    supports_prefixes = False
    supports_speculation = False  # verify / discard are not replicated (config refuses both options together)

    def __init__(self, inner: KVLayout, *, send: Callable[[Op], Any] = broadcast,
                 on_error: Callable[[str], None] | None = None, heartbeat: float | None = HEARTBEAT_SECONDS):
        self.inner = inner
        self._send = send
        self._on_error = on_error
        self._lock = threading.Lock()
        self._next_id = 0
        self._dropped: deque[int] = deque()  # appended from finalizers, on whatever thread collects
        self._last_sent = time.monotonic()
        self.broken: str | None = None
        if heartbeat:
            threading.Thread(target=self._beat, args=(heartbeat,), name="tp-heartbeat", daemon=True).start()

    def prefill(self, model: Any, prompts: Sequence[Sequence[int]], *, pad_id: int, device: torch.device,
                prompt_logits: bool = False, model_inputs: Mapping[str, Any] | None = None) -> Prefilled:
        if model_inputs:  # an Op carries token ids only; images would have to be broadcast too
            raise ValueError("tensor-parallel serving does not carry images yet")
        with self._lock:
            batch = self._next_id
            self._next_id += 1
            op = Op(PREFILL, batch, tuple(tuple(int(t) for t in p) for p in prompts), pad_id=pad_id,
                    prompt_logits=prompt_logits)
            out = self._run(op, lambda: self.inner.prefill(model, prompts, pad_id=pad_id, device=device,
                                                          prompt_logits=prompt_logits))
        return replace(out, kv=ReplicatedBatch(self, batch, out.kv))

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def supports_chunks(self) -> bool:  # PREFILL_MORE is replicated
        return self.inner.supports_chunks

    def prepare(self, model: Any) -> None:
        self.inner.prepare(model)  # local: each follower prepares its own shard (follow's caller)

    def memory_bytes(self, model: Any, rows: int, columns: int) -> int | None:
        return self.inner.memory_bytes(model, rows, columns)

    def run(self, op: Op, local: Callable[[], Any]) -> Any:
        """Send `op` to the followers, then run `local` (the same op on rank 0's batch)."""
        with self._lock:
            return self._run(op, local)

    def _run(self, op: Op, local: Callable[[], Any]) -> Any:
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            self._send(replace(op, dropped=self._take_dropped()))
            self._last_sent = time.monotonic()
            return local()
        except Exception as exc:
            self.broken = f"{op.kind} failed on rank 0, so the ranks are out of step: {exc}"
            if self._on_error is not None:
                self._on_error(self.broken)
            raise

    def _take_dropped(self) -> tuple[int, ...]:
        dropped = []
        while self._dropped:
            dropped.append(self._dropped.popleft())
        return tuple(dropped)

    def dropped(self, batch: int) -> None:
        """Rank 0 let go of `batch` (a finalizer): the followers drop theirs with the next op."""
        self._dropped.append(batch)

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the followers to leave their loop (a clean shutdown); nothing if an op still runs after
        `timeout` seconds (then the followers end when rank 0's process does)."""
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            if self.broken is None:
                self.broken = "stopped"
                self._send(Op(STOP, dropped=self._take_dropped()))
        finally:
            self._lock.release()

    def _beat(self, every: float) -> None:
        while self.broken is None:
            time.sleep(every / 2)
            if time.monotonic() - self._last_sent < every or not self._lock.acquire(blocking=False):
                continue  # an op went out lately, or one is running now
            try:
                if self.broken is None:
                    self._run(Op(NOOP), lambda: None)
            except Exception:
                log.exception("Tensor parallel heartbeat failed")
            finally:
                self._lock.release()


class ReplicatedBatch:
    """Rank 0's KVBatch: each operation goes to every rank first (Replicator.run), then runs here."""

    def __init__(self, replicator: Replicator, batch: int, local: KVBatch):
        self.replicator, self.batch, self.local = replicator, batch, local
        weakref.finalize(self, replicator.dropped, batch)

    def __len__(self) -> int:
        return len(self.local)

    def feed(self, tokens: torch.Tensor) -> None:
        ids = tuple(tokens.tolist())
        self.replicator.run(Op(FEED, self.batch, ids), lambda: self.local.feed(tokens))

    def decode(self) -> torch.Tensor:
        return self.replicator.run(Op(DECODE, self.batch), self.local.decode)

    def keep(self, indices: Sequence[int]) -> None:
        rows = tuple(int(i) for i in indices)
        self.replicator.run(Op(KEEP, self.batch, rows), lambda: self.local.keep(indices))

    def extend(self, other: "ReplicatedBatch") -> None:
        self.replicator.run(Op(EXTEND, self.batch, other=other.batch), lambda: self.local.extend(other.local))

    def prefill_more(self, tokens: Sequence[int]) -> torch.Tensor:
        """Only called where the wrapped layout `supports_chunks` (Replicator declares what it does)."""
        ids = tuple(int(t) for t in tokens)
        return self.replicator.run(Op(PREFILL_MORE, self.batch, ids), lambda: self.local.prefill_more(tokens))

    def held_bytes(self) -> int:
        return held_bytes(self.local)

    def eviction_order(self, survivors: Sequence[int]) -> list[int]:
        """Rank 0's choice; the ranks then replay the `keep` it leads to."""
        return eviction_order(self.local, survivors)


def follow(model: Any, layout: KVLayout, device: torch.device, receive: Callable[[], Op] = lambda: broadcast(None)
           ) -> dict[int, KVBatch]:
    """A follower rank's loop: apply rank 0's ops to batches of its own until STOP, then return the
    batches still held (those rank 0 still held). `layout` is rank 0's, unwrapped, already prepared
    for `model` (engine/build.py `follower_layout`). An exception (a collective's timeout, rank 0 gone)
    leaves the loop: the process ends and rank 0 notices."""
    batches: dict[int, KVBatch] = {}
    while True:
        op = receive()
        for batch in op.dropped:
            batches.pop(batch, None)
        if op.kind == STOP:
            return batches
        if op.kind == NOOP:
            continue
        if op.kind == PREFILL:
            batches[op.batch] = layout.prefill(model, [list(p) for p in op.ids], pad_id=op.pad_id, device=device,
                                               prompt_logits=op.prompt_logits).kv
        elif op.kind == FEED:
            batches[op.batch].feed(torch.tensor(op.ids, dtype=torch.long, device=device))
        elif op.kind == DECODE:
            batches[op.batch].decode()
        elif op.kind == KEEP:
            batches[op.batch].keep(list(op.ids))
        elif op.kind == EXTEND:
            batches[op.batch].extend(batches.pop(op.other))
        elif op.kind == PREFILL_MORE:
            batches[op.batch].prefill_more(list(op.ids))
        else:
            raise ValueError(f"unknown tensor-parallel op {op.kind!r}")
