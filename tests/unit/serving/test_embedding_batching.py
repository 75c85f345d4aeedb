"""Embeddings batched across requests: the built-in embedding handler gets dynamic batching when the
user sets none (serving/service.py ENCODER_BATCHING), so concurrent requests share forwards, and each
request's vector equals the one it gets alone."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import ModelConfig, build_server_config
from lmi_serve.handler_api import Input
from lmi_serve.serving.handlers import embeddings
from lmi_serve.serving.service import ModelService, ModelStatus

# Padded rows in float32 with an attention mask: the masked keys' softmax weights are exactly 0, but a
# padded matmul may sum in another order. Measured on all-MiniLM-L6-v2 (AMD EPYC, torch CPU): largest
# difference 1.8e-7 per component of a unit vector (this test's 16 sentences, 1 to 4 lengths padded together).
TOLERANCE = 1e-6
SENTENCES = [f"Sentence number {i} is about " + "the rivers and mountains of Europe " * (i % 4) for i in range(16)]


def dispatcher_of(config: ModelConfig, *, builtin: bool, task: str = "text-embedding"):
    service = ModelService(config, "/nonexistent")
    service.task = task
    caps = SimpleNamespace(builtin=builtin, handle=lambda request: None)
    return service, service._dispatcher(caps, rolling=False)


def test_a_builtin_embedding_handler_batches_unless_the_user_says_otherwise():
    service, dispatcher = dispatcher_of(ModelConfig(name="e"), builtin=True)
    assert (dispatcher.batch_size, dispatcher._delay) == (32, 0.0)
    assert (service.config.batch_size, service.config.max_batch_delay) == (32, 0)  # what /models/<m> reports
    _, dispatcher = dispatcher_of(ModelConfig(name="e", batch_size=1), builtin=True)
    assert (dispatcher.batch_size, dispatcher._delay) == (1, 0.0)
    _, dispatcher = dispatcher_of(ModelConfig(name="e", batch_size=8, max_batch_delay=50), builtin=True)
    assert (dispatcher.batch_size, dispatcher._delay) == (8, 0.05)
    _, dispatcher = dispatcher_of(ModelConfig(name="e"), builtin=False)  # a model.py: DJL's defaults
    assert (dispatcher.batch_size, dispatcher._delay) == (1, 0.1)
    _, dispatcher = dispatcher_of(ModelConfig(name="t", task="tensor"), builtin=True, task="tensor")
    assert (dispatcher.batch_size, dispatcher._delay) == (1, 0.1)


def test_token_budget_chunks_sort_by_length_and_keep_within_the_budget():
    assert embeddings.token_budget_chunks([5, 1, 3], 100) == [[1, 2, 0]]
    assert embeddings.token_budget_chunks([10, 10, 10, 40], 30) == [[0, 1, 2], [3]]
    assert embeddings.token_budget_chunks([10, 10, 10], 25) == [[0, 1], [2]]


def request(sentence: str) -> Input:
    """One sentence, as /v1/embeddings submits it."""
    return Input.from_http(json.dumps({"inputs": [sentence]}).encode(), {"Content-Type": "application/json"}, [], "")


@pytest.fixture(scope="module")
def embedding_service():
    config = next(m for m in build_server_config({"HOME": "/tmp"}, default_store=DEFAULT_STORE).models
                  if m.task == "text-embedding")
    service = ModelService(config, "/tmp/lmi-test-cache")
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    return service


def test_concurrent_requests_share_forwards_and_keep_their_vectors(embedding_service, monkeypatch):
    service = embedding_service
    assert service.dispatcher.batch_size == 32  # the embedded default sets neither option
    handler = service.capabilities.handle.__globals__["_service"]  # this model's own handler module's
    alone = [handler.embed([s])[0] for s in SENTENCES]

    forwards, started, release = [], threading.Event(), threading.Event()
    real_forward = handler.forward

    def counted_forward(rows):
        forwards.append(len(rows))
        started.set()
        release.wait(30)  # hold the first forward until every request is queued
        return real_forward(rows)

    monkeypatch.setattr(handler, "forward", counted_forward)
    before = service.dispatcher.stats.batches
    first = service.submit(request(SENTENCES[0]))
    assert started.wait(30)
    jobs = [first] + [service.submit(request(s)) for s in SENTENCES[1:]]
    release.set()
    outputs = [service.dispatcher.wait(job) for job in jobs]
    vectors = [json.loads(out.body())[0] for out in outputs]

    assert service.dispatcher.stats.batches - before == 2 and sorted(forwards) == [1, 15]
    worst = max(abs(x - y) for v, a in zip(vectors, alone) for x, y in zip(v, a, strict=True))
    print(f"largest difference batched vs alone: {worst:.3g}")
    assert worst <= TOLERANCE
