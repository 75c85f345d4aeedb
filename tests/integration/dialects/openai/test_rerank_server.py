"""The real server with two tiny text-classification models (a one-label cross-encoder and a two-label
sentiment classifier, tests/tiny_classifier.py), inferred from their config.json: vLLM's /rerank, /score
and /classify, LMI's /invocations, Triton's infer (with tritonclient), /v1/models, and the scores
against transformers' own forward. Concurrent rerank requests share forwards. One server for the module."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from tiny_classifier import reference_logits, sigmoid

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5
QUERY = "how do plants make food?"
DOCUMENTS = ["Plants make food by photosynthesis in their leaves.", "The stock market fell on Monday.",
             "Photosynthesis turns light, water and carbon dioxide into sugar.", "Cats sleep a lot."]


@pytest.fixture(scope="module")
def models(classifiers):
    return classifiers


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # the shared tiny store (integration/conftest.py), with `rr` and `senti` among its models


def post(server, path: str, body) -> requests.Response:
    return requests.post(server.url(path), json=body, timeout=120)


def test_the_models_are_served_as_text_classification(server):
    assert {m["id"] for m in requests.get(server.url("/v1/models"), timeout=10).json()["data"]} >= {"rr", "senti"}
    for name in ("rr", "senti"):
        entry = requests.get(server.url(f"/models/{name}"), timeout=10).json()[0]["models"][0]
        assert entry["task"] == "text-classification" and entry["architectures"] == ["BertForSequenceClassification"]
        assert (entry["batchSize"], entry["maxBatchDelayMillis"]) == (32, 0)


def test_rerank_and_score_equal_transformers_forward(server, models):
    want = [sigmoid(r[0]) for r in reference_logits(models["rr"], [QUERY] * len(DOCUMENTS), DOCUMENTS)]
    body = post(server, "/v1/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: want[i], reverse=True)[:3]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        sorted(want, reverse=True)[:3], abs=TOLERANCE)
    assert body["results"][0]["document"]["text"] == DOCUMENTS[body["results"][0]["index"]]
    scored = post(server, "/score", {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=TOLERANCE)
    assert scored["usage"]["total_tokens"] == body["usage"]["total_tokens"]


def test_classify_and_invocations(server, models):
    texts = ["What a wonderful day", "This is terrible"]
    logits = reference_logits(models["senti"], texts)
    body = post(server, "/classify", {"model": "senti", "input": texts}).json()
    for item, row in zip(body["data"], logits):
        exps = [math.exp(x) for x in row]
        assert item["probs"] == pytest.approx([e / sum(exps) for e in exps], abs=TOLERANCE)
        assert item["num_classes"] == 2 and item["label"] in ("NEGATIVE", "POSITIVE")
    answer = requests.post(server.url("/invocations"), params={"model_name": "senti"},
                           json={"inputs": texts[0]}, timeout=60).json()
    assert answer == [{"label": body["data"][0]["label"], "score": pytest.approx(max(body["data"][0]["probs"]),
                                                                                   abs=TOLERANCE)}]
    pairs = requests.post(server.url("/invocations"), params={"model_name": "rr"},
                          json={"inputs": [{"text": QUERY, "text_pair": DOCUMENTS[0]}]}, timeout=60).json()
    want = reference_logits(models["rr"], [QUERY], DOCUMENTS[:1])[0][0]
    assert pairs == [{"label": "LABEL_0", "score": pytest.approx(sigmoid(want), abs=TOLERANCE)}]


def test_triton_infer_with_tritonclient(server, models):
    client = triton.InferenceServerClient(server.url("").removeprefix("http://"))
    text, pair = triton.InferInput("text_input", [2], "BYTES"), triton.InferInput("text_pair", [2], "BYTES")
    text.set_data_from_numpy(np.array([QUERY, QUERY], dtype=object))
    pair.set_data_from_numpy(np.array(DOCUMENTS[:2], dtype=object))
    result = client.infer("rr", [text, pair], outputs=[triton.InferRequestedOutput("scores")])
    want = reference_logits(models["rr"], [QUERY] * 2, DOCUMENTS[:2])
    assert result.as_numpy("scores").reshape(-1).tolist() == pytest.approx([sigmoid(w[0]) for w in want],
                                                                          abs=TOLERANCE)
    assert client.get_model_metadata("senti")["outputs"][0] == {"name": "logits", "datatype": "FP32", "shape": [-1, 2]}


def test_errors_are_in_each_dialects_shape(server):
    empty = post(server, "/v2/rerank", {"model": "rr", "query": "q", "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    wrong_task = post(server, "/v1/completions", {"model": "rr", "prompt": "hi"})
    assert wrong_task.status_code == 400 and "serves text-classification" in wrong_task.json()["error"]["message"]
    not_a_reranker = post(server, "/rerank", {"model": "senti", "query": "q", "documents": ["d"]})
    assert not_a_reranker.status_code == 400 and not_a_reranker.json()["error"]["param"] == "model"


def test_concurrent_reranks_share_forwards_and_keep_their_scores(server):
    def stats() -> dict:
        return requests.get(server.url("/models/rr"), timeout=10).json()[0]["models"][0]["batchStats"]

    def rerank(documents) -> list[float]:
        body = post(server, "/rerank", {"model": "rr", "query": QUERY, "documents": documents}).json()
        return [r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])]

    alone = [rerank([d])[0] for d in DOCUMENTS]
    before = stats()
    scores: list = [None] * 8
    # a long request holds the model while the 8 small ones queue behind it
    holder = threading.Thread(target=rerank, args=(["a long document about the weather at sea " * 40] * 96,))
    holder.start()
    clients = [threading.Thread(target=lambda i=i: scores.__setitem__(i, rerank([DOCUMENTS[i % 4]])[0]))
               for i in range(8)]
    for t in clients:
        t.start()
    for t in [holder, *clients]:
        t.join()
    after = stats()
    assert after["requests"] - before["requests"] == 9
    assert after["batches"] - before["batches"] < 9 and after["largestBatch"] > 1
    assert scores == pytest.approx([alone[i % 4] for i in range(8)], abs=TOLERANCE)
