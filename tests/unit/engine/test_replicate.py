"""engine/kv/replicate.py: rank 0's KV-seam calls, replayed by a follower, give the follower the same
forwards (bit for bit, with the same weights) through a real scheduler run with joins, leaves and
chunked prefills; a failure breaks the group loudly; an idle rank 0 sends heartbeats.

The follower here is a thread with its own copy of the model, fed by a queue instead of a
torch.distributed broadcast (tests/integration/models/test_tensor_parallel.py runs real gloo ranks)."""

from __future__ import annotations

import copy
import gc
import queue
import threading

import pytest
import torch

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.kv.replicate import DECODE, EXTEND, KEEP, NOOP, PREFILL, PREFILL_MORE, Op, Replicator, follow
from lmi_serve.engine.kv.slots import SLOTS, SlotKV, SlotLayout
from lmi_serve.engine.scheduler import Scheduler
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams
from lmi_serve.errors import GenerationFailed

from engine_prompts import PROMPTS  # noqa: E402
from waiting import within  # noqa: E402

CPU = torch.device("cpu")


def recording_kv(log: list[torch.Tensor]) -> SlotLayout:
    """The slots layout of a SlotKV that appends every logits tensor its forwards return to `log`."""

    class Recorded(SlotKV):
        @classmethod
        def prefill(cls, model, prompts, **kwargs):
            out = super().prefill(model, prompts, **kwargs)
            log.append(out.logits.clone())
            return out

        def decode(self):
            logits = super().decode()
            log.append(logits.clone())
            return logits

        def prefill_more(self, tokens):
            logits = super().prefill_more(tokens)
            log.append(logits.clone())
            return logits

    return SlotLayout(Recorded)


class Follower(threading.Thread):
    """`follow` on a thread, its ops from a queue; `held` is what it returned at STOP."""

    def __init__(self, model, layout):
        super().__init__(daemon=True)
        self.ops: queue.SimpleQueue[Op] = queue.SimpleQueue()
        self.seen: list[str] = []
        self.model, self.layout, self.held, self.error = model, layout, None, None

    def receive(self) -> Op:
        op = self.ops.get(timeout=60)
        self.seen.append(op.kind)
        return op

    def run(self) -> None:
        try:
            self.held = follow(self.model, self.layout, CPU, self.receive)
        except Exception as exc:  # the test reads it
            self.error = exc


def test_a_follower_replays_every_forward_of_a_scheduler_run(tiny_model, smollm2_tokenizer):
    rank0_logits, follower_logits = [], []
    follower_model = copy.deepcopy(tiny_model)
    follower_layout = recording_kv(follower_logits)
    follower_layout.prepare(follower_model)  # as engine/build.py's follower_layout does
    follower = Follower(follower_model, follower_layout)
    follower.start()
    replicator = Replicator(recording_kv(rank0_logits), send=follower.ops.put, heartbeat=None)
    # 3 rows for 6 requests (rows leave and join), a prefill budget of 12 tokens (long prompts in chunks)
    scheduler = Scheduler(tiny_model, smollm2_tokenizer, CPU, max_batch_size=3, max_queue=10,
                          max_prefill_tokens=12, kv_layout=replicator)
    requests = [GenerationRequest(tuple(smollm2_tokenizer.encode(p)), SamplingParams(),
                                  StopParams(max_new_tokens=3 + 2 * i, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:6])]
    handles = [RequestHandle(r, deadline=None) for r in requests]
    for handle in handles:
        scheduler.add(handle)
    for _ in range(200):
        if scheduler.idle:
            break
        scheduler.step()
    assert [h.result().finish_reason for h in handles] == [FinishReason.LENGTH] * len(handles)
    del scheduler
    gc.collect()  # rank 0's batches are gone: the next op tells the follower to drop its own
    replicator.stop()
    follower.join(60)
    assert follower.error is None and not follower.is_alive()
    assert follower.held == {}
    assert {PREFILL, DECODE, KEEP, EXTEND, PREFILL_MORE} <= set(follower.seen)
    assert len(follower_logits) == len(rank0_logits) > len(requests)
    assert all(torch.equal(a, b) for a, b in zip(rank0_logits, follower_logits))


def test_a_failed_op_breaks_the_group_and_later_ops_refuse(tiny_model):
    failures: list[str] = []

    def send(op: Op) -> None:
        if op.kind == DECODE:
            raise RuntimeError("Connection reset by peer")

    replicator = Replicator(SLOTS, send=send, on_error=failures.append, heartbeat=None)
    out = replicator.prefill(tiny_model, [[5, 6, 7]], pad_id=0, device=CPU)
    out.kv.feed(torch.tensor([8]))
    with pytest.raises(RuntimeError, match="Connection reset"):
        out.kv.decode()
    assert len(failures) == 1 and "decode failed on rank 0" in failures[0] and "Connection reset" in failures[0]
    with pytest.raises(RuntimeError, match="tensor-parallel group is broken"):
        replicator.prefill(tiny_model, [[5]], pad_id=0, device=CPU)
    assert len(failures) == 1


def test_an_idle_rank_0_sends_heartbeats_until_stopped():
    sent: list[str] = []
    two = threading.Event()

    def send(op: Op) -> None:
        sent.append(op.kind)
        if sent.count(NOOP) >= 2:
            two.set()

    replicator = Replicator(SLOTS, send=send, heartbeat=0.05)
    assert two.wait(30), "no heartbeat came"
    replicator.stop()
    assert sent[-1] == "stop" and set(sent) == {NOOP, "stop"}
    with pytest.raises(RuntimeError, match="broken: stopped"):
        replicator.run(Op(DECODE), lambda: None)


def test_a_group_broken_mid_step_fails_the_engine_and_every_request(tiny_model, smollm2_tokenizer):
    """The path of a dead rank found by a forward: the replicator's on_error fails the engine from
    its own scheduler thread; the running and the waiting request both end with the reason."""
    decodes = []

    def send(op: Op) -> None:
        if op.kind == DECODE:
            decodes.append(op)
            if len(decodes) == 3:
                raise RuntimeError("Connection reset by peer")

    holder = {}
    replicator = Replicator(SLOTS, send=send, on_error=lambda reason: holder["engine"].fail(reason),
                            heartbeat=None)
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=1, kv_layout=replicator)
    holder["engine"] = engine.start()
    try:
        request = GenerationRequest(tuple(smollm2_tokenizer.encode(PROMPTS[1])),
                                    stop=StopParams(max_new_tokens=50, ignore_eos=True))
        running, waiting = engine.generate([request]), engine.generate([request])  # one row: the second waits
        (result,) = within(running.results)  # it had tokens: they stay, and the step's error ends it
        assert len(result.events) > 1 and "Connection reset by peer" in result.error
        with pytest.raises(GenerationFailed, match="decode failed on rank 0.*Connection reset by peer"):
            within(waiting.results)  # failed before its first token: raised
    finally:
        engine.stop()
    assert engine.failure is not None and "Connection reset by peer" in engine.failure
    assert not engine.alive
