"""DynamicBatcher with fake handlers: windowing, batch splitting, errors, queue bounds, timeouts."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lmi_serve.errors import Overloaded, Timeout
from lmi_serve.handler_api import Input, Output
from lmi_serve.serving.batching import DynamicBatcher


def request(payload) -> Input:
    return Input.from_http(json.dumps(payload).encode(), {"Content-Type": "application/json"}, [], "rid")


class RecordingHandler:
    """Echoes each batch member's 'value' doubled, and remembers the batch sizes it saw."""

    def __init__(self, gate: threading.Event | None = None):
        self.sizes: list[int] = []
        self.gate = gate

    def __call__(self, inputs: Input) -> Output:
        if self.gate:
            self.gate.wait(10)
        members = inputs.get_batches()
        self.sizes.append(len(members))
        out = Output()
        for i, member in enumerate(members):
            value = member.get_as_json()["value"]
            if value < 0:
                out.add({"code": 424, "error": "negative"}, batch_index=i if inputs.is_batch() else None)
                out.add_property(f"batch_{i}.code", "424")
            else:
                out.add({"double": value * 2}, batch_index=i if inputs.is_batch() else None)
        return out


def make(handler, **overrides) -> DynamicBatcher:
    settings = dict(batch_size=4, max_batch_delay_ms=2000, job_queue_size=100, predict_timeout=30)
    settings.update(overrides)
    batcher = DynamicBatcher("m", handler, **settings)
    batcher.start()
    return batcher


def test_jobs_arriving_within_the_window_share_one_call():
    handler = RecordingHandler()
    batcher = make(handler)
    jobs = [batcher.submit(request({"value": v})) for v in (1, 2, 3, 4)]
    outputs = [batcher.wait(job) for job in jobs]
    assert handler.sizes == [4]
    assert [json.loads(o.body()) for o in outputs] == [{"double": 2}, {"double": 4}, {"double": 6}, {"double": 8}]
    assert batcher.stats.batches == 1 and batcher.stats.largest_batch == 4


def test_a_full_batch_does_not_wait_for_the_window_and_extra_jobs_go_to_the_next_call():
    handler = RecordingHandler()
    batcher = make(handler, batch_size=2, max_batch_delay_ms=60_000)
    jobs = [batcher.submit(request({"value": v})) for v in (1, 2, 3, 4)]
    for job in jobs:
        batcher.wait(job)
    assert handler.sizes == [2, 2]


def test_one_bad_member_fails_alone():
    batcher = make(RecordingHandler(), batch_size=3, max_batch_delay_ms=5000)
    jobs = [batcher.submit(request({"value": v})) for v in (1, -1, 3)]
    codes = [batcher.wait(job).code for job in jobs]
    assert codes == [200, 424, 200]


def test_handler_exceptions_become_424_and_memory_errors_507():
    def failing(inputs: Input) -> Output:
        raise ValueError("boom") if inputs.get_as_json()["value"] else MemoryError("no room")

    batcher = make(failing, batch_size=1, max_batch_delay_ms=0)
    failed = batcher.wait(batcher.submit(request({"value": 1})))
    assert failed.code == 424
    assert json.loads(failed.body()) == {"code": 424, "message": "invoke handler failure", "error": "boom"}
    assert batcher.wait(batcher.submit(request({"value": 0}))).code == 507


def test_a_full_queue_rejects_with_overloaded():
    gate = threading.Event()
    handler = RecordingHandler(gate)
    batcher = make(handler, batch_size=1, max_batch_delay_ms=0, job_queue_size=1)
    first = batcher.submit(request({"value": 1}))
    deadline = time.monotonic() + 10
    while batcher.queued and time.monotonic() < deadline:  # wait until the worker took the first job
        time.sleep(0.01)
    second = batcher.submit(request({"value": 2}))
    with pytest.raises(Overloaded, match="queue capacity exceeded for model: m"):
        batcher.submit(request({"value": 3}))
    gate.set()
    assert batcher.wait(first).code == 200 and batcher.wait(second).code == 200


def test_waiting_past_predict_timeout_raises_and_the_job_is_skipped():
    gate = threading.Event()
    handler = RecordingHandler(gate)
    batcher = make(handler, batch_size=1, max_batch_delay_ms=0, predict_timeout=0.3)
    blocker = batcher.submit(request({"value": 1}))
    late = batcher.submit(request({"value": 2}))
    with pytest.raises(Timeout, match="timed out"):
        batcher.wait(late)
    with pytest.raises(Timeout):
        batcher.wait(blocker)  # predict_timeout bounds queueing and inference together
    gate.set()
    deadline = time.monotonic() + 5
    while batcher.stats.batches < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert handler.sizes == [1]  # the expired job never reached the handler


def test_streamed_output_is_pumped_on_the_batcher_thread():
    threads = []

    def streaming(inputs: Input) -> Output:
        def tokens():
            for word in ("a", "b", "c"):
                threads.append(threading.current_thread().name)
                yield [word]
        return Output().add_stream_content(tokens())

    batcher = make(streaming, batch_size=1, max_batch_delay_ms=0)
    job = batcher.submit(request({"value": 1}))
    assert batcher.wait(job).is_stream()
    chunks = [json.loads(c) for c in job.stream()]
    assert chunks == [{"outputs": ["a"]}, {"outputs": ["b"]}, {"outputs": ["c"]}]
    assert set(threads) == {"batcher-m"}
