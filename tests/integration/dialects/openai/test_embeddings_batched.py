"""Concurrent /v1/embeddings requests to the embedded MiniLM share forwards (its default dynamic batching,
serving/service.py ENCODER_BATCHING), and each gets the vector it gets alone. On the session's
`default_server` (tests/conftest.py: the embedded defaults, as this module served them), not a server
of its own: one start fewer (~9 s); the counts are differences of the model's batch stats."""

from __future__ import annotations

import threading

import pytest
import requests

MODEL = "all-minilm-l6-v2"
SENTENCES = [f"Request {i} asks about " + "the rivers and mountains of Europe " * (i % 4) for i in range(16)]
TOLERANCE = 1e-6  # padding in float32: measured 1.8e-7 (tests/unit/serving/test_embedding_batching.py)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def embedding_server(default_server):
    return default_server  # the embedded defaults, MiniLM among them (tests/conftest.py)


def embed(server, inputs) -> list[list[float]]:
    response = requests.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": inputs}, timeout=120)
    assert response.status_code == 200, response.text
    return [d["embedding"] for d in response.json()["data"]]


def batch_stats(server) -> dict:
    entry = requests.get(server.url(f"/models/{MODEL}"), timeout=10).json()[0]["models"][0]
    assert (entry["batchSize"], entry["maxBatchDelayMillis"]) == (32, 0)
    return entry["batchStats"]


def test_concurrent_requests_share_forwards_and_keep_their_vectors(embedding_server):
    alone = [embed(embedding_server, s)[0] for s in SENTENCES]
    before = batch_stats(embedding_server)
    # a long request holds the model while the 16 single sentences queue behind it: 128 inputs of 252
    # tokens (MiniLM's max_seq_length is 256) in a 64 KB body (the shared server takes at most 100,000 bytes)
    long_inputs = ["a " * 250] * 128
    vectors: list = [None] * len(SENTENCES)

    def client(i: int) -> None:
        vectors[i] = embed(embedding_server, SENTENCES[i])[0]

    holder = threading.Thread(target=embed, args=(embedding_server, long_inputs))
    holder.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(SENTENCES))]
    for t in threads:
        t.start()
    for t in [holder, *threads]:
        t.join()
    after = batch_stats(embedding_server)
    requests_served, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests_served == 17 and batches < 17 // 2, (requests_served, batches)
    worst = max(abs(x - y) for v, a in zip(vectors, alone) for x, y in zip(v, a, strict=True))
    assert worst <= TOLERANCE
