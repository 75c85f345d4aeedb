"""A model store: dynamic batching, legacy streaming, custom model.py handlers, handler fallback."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.integration


def post(server, path, body, **kwargs):
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def batch_stats(server, model):
    return requests.get(server.url(f"/models/{model}"), timeout=10).json()[0]["models"][0]["batchStats"]


def test_ping_lists_every_model_in_the_store(store_server):
    body = requests.get(store_server.url("/ping"), timeout=10).json()
    assert set(body) == {"batched", "streaming", "custom", "fallback"}
    assert all(entry["status"] == "Healthy" for entry in body.values())


def test_concurrent_requests_share_one_batched_forward(store_server):
    bodies = [
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}},
        {"inputs": "One, two, three,", "parameters": {"max_new_tokens": 12}},
        {"inputs": "Once upon a time", "parameters": {"do_sample": True, "seed": 3, "max_new_tokens": 8}},
        {"inputs": ["Red, green,", "Monday, Tuesday,"], "parameters": {"repetition_penalty": 1.3}},
    ]
    before = batch_stats(store_server, "batched")
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(store_server, "/predictions/batched", b), bodies))
    after = batch_stats(store_server, "batched")
    assert [r.status_code for r in responses] == [200] * 4
    assert after["batches"] == before["batches"] + 1
    assert after["lastBatchSize"] == 4 and after["largestBatch"] == 4
    assert "Paris" in responses[0].json()[0]["generated_text"]
    assert len(responses[3].json()) == 2
    # The same greedy request alone gives the same text as it did in company.
    alone = post(store_server, "/predictions/batched", bodies[1])
    assert alone.json() == responses[1].json()


def test_a_bad_request_fails_alone_inside_a_batch(store_server):
    bodies = [{"inputs": f"Count to {n}:", "parameters": {"max_new_tokens": 4}} for n in (2, 3, 4)]
    bodies.insert(1, {"inputs": "x", "parameters": {"top_k": -1}})
    before = batch_stats(store_server, "batched")
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(store_server, "/predictions/batched", b), bodies))
    assert batch_stats(store_server, "batched")["batches"] == before["batches"] + 1
    assert [r.status_code for r in responses] == [200, 424, 200, 200]
    assert "top_k" in responses[1].json()["error"]
    assert all(isinstance(r.json()[0]["generated_text"], str) for i, r in enumerate(responses) if i != 1)


def test_streaming_model_sends_jsonlines_outputs(store_server):
    body = {"inputs": "Say something about café culture in 東京 🚀", "parameters": {"max_new_tokens": 24}}
    response = requests.post(store_server.url("/predictions/streaming"), json=body, stream=True, timeout=120)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/jsonlines")
    assert "Content-Length" not in response.headers
    lines = [json.loads(line) for line in response.iter_lines() if line]
    assert len(lines) > 1
    assert all(set(line) == {"outputs"} and len(line["outputs"]) == 1 for line in lines)
    streamed = "".join(line["outputs"][0] for line in lines)
    assert "\ufffd" not in streamed
    whole = post(store_server, "/predictions/batched", body).json()[0]["generated_text"]
    assert streamed == whole


def test_custom_model_py_handles_requests(store_server):
    response = post(store_server, "/predictions/custom", {"text": "shout"},
                    headers={"X-Amzn-SageMaker-Custom-Attributes": "a=1;b=2", "x-request-id": "req-7"})
    assert response.status_code == 200
    assert response.headers["X-Custom-Handler"] == "yes"
    assert response.json() == {"upper": "SHOUT", "greeting": "hello", "attribute_a": "1", "request_id": "req-7"}


def test_custom_handler_failures_map_to_424_and_507(store_server):
    failed = post(store_server, "/predictions/custom", {"fail": "value"})
    assert failed.status_code == 424
    assert failed.json() == {"code": 424, "message": "invoke handler failure", "error": "custom failure requested"}
    oom = post(store_server, "/predictions/custom", {"fail": "oom"})
    assert oom.status_code == 507 and "out of memory" in oom.json()["error"]
    assert post(store_server, "/predictions/custom", {"text": "ok"}).json()["upper"] == "OK"


def test_model_py_without_handle_falls_back_to_the_builtin_handler(store_server):
    response = post(store_server, "/predictions/fallback", {"inputs": ["a", "b"]})
    assert response.status_code == 200
    assert [len(v) for v in response.json()] == [384, 384]


def test_invocations_without_model_name_uses_the_first_text_generation_model(store_server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}}
    assert post(store_server, "/invocations", body).json() == post(store_server, "/predictions/batched", body).json()


def _wait_for(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def _describe(server, model):
    return requests.get(server.url(f"/models/{model}"), timeout=10).json()[0]["models"][0]


def test_a_full_queue_answers_503_and_the_model_recovers(store_server):
    """custom has job_queue_size=1: one request running, one waiting, the third is refused."""
    batches = _describe(store_server, "custom")["batchStats"]["batches"]
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, store_server, "/predictions/custom", {"text": "a", "sleep": 2})
        _wait_for(lambda: _describe(store_server, "custom")["batchStats"]["batches"] == batches + 1)
        waiting = pool.submit(post, store_server, "/predictions/custom", {"text": "b"})
        _wait_for(lambda: _describe(store_server, "custom")["requestInQueue"] == 1)
        refused = post(store_server, "/predictions/custom", {"text": "c"})
        assert refused.status_code == 503
        assert refused.json() == {"code": 503, "type": "WlmCapacityException",
                                  "message": "Worker queue capacity exceeded for model: custom"}
        assert running.result().json()["upper"] == "A" and waiting.result().json()["upper"] == "B"
    assert post(store_server, "/predictions/custom", {"text": "d"}).json()["upper"] == "D"


def test_a_prediction_over_predict_timeout_answers_504(store_server):
    """custom has option.predict_timeout=4."""
    late = post(store_server, "/predictions/custom", {"text": "slow", "sleep": 5})
    assert late.status_code == 504
    assert late.json()["type"] == "TimeoutException" and "timed out after 4 s" in late.json()["message"]
    _wait_for(lambda: post(store_server, "/predictions/custom", {"text": "e"}).status_code == 200)
