"""A model store: dynamic batching, legacy streaming, custom model.py handlers, handler fallback."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from server_process import wait_for

pytestmark = pytest.mark.integration


def post(server, path, body, **kwargs):
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def test_ping_lists_every_model_in_the_store(store_server):
    body = requests.get(store_server.url("/ping"), timeout=10).json()
    assert set(body) == {"batched", "dynamic", "faulty", "formatted", "tgi", "short", "prefixed", "streaming",
                         "custom", "fallback"}
    assert all(entry["status"] == "Healthy" for entry in body.values())


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


def _describe(server, model):
    return requests.get(server.url(f"/models/{model}"), timeout=10).json()[0]["models"][0]


def test_a_full_queue_answers_503_and_the_model_recovers(store_server):
    """custom has job_queue_size=1: one request running, one waiting, the third is refused."""
    batches = _describe(store_server, "custom")["batchStats"]["batches"]
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, store_server, "/predictions/custom", {"text": "a", "sleep": 2})
        wait_for(lambda: _describe(store_server, "custom")["batchStats"]["batches"] == batches + 1)
        waiting = pool.submit(post, store_server, "/predictions/custom", {"text": "b"})
        wait_for(lambda: _describe(store_server, "custom")["requestInQueue"] == 1)
        refused = post(store_server, "/predictions/custom", {"text": "c"})
        assert refused.status_code == 503
        message = "Worker queue capacity exceeded for model: custom"
        assert refused.json() == {"code": 503, "type": "WlmCapacityException", "message": message, "error": message}
        assert running.result().json()["upper"] == "A" and waiting.result().json()["upper"] == "B"
    assert post(store_server, "/predictions/custom", {"text": "d"}).json()["upper"] == "D"


def test_a_prediction_over_predict_timeout_answers_504(store_server):
    """custom has option.predict_timeout=4."""
    late = post(store_server, "/predictions/custom", {"text": "slow", "sleep": 5})
    assert late.status_code == 504
    assert late.json()["type"] == "TimeoutException" and "timed out after 4 s" in late.json()["message"]
    wait_for(lambda: post(store_server, "/predictions/custom", {"text": "e"}).status_code == 200)


def test_model_py_formatters_shape_requests_and_responses(store_server):
    whole = post(store_server, "/predictions/formatted", {"question": "1, 2, 3, 4,"})
    assert whole.status_code == 200
    body = json.loads(whole.text)
    assert body == {"answer": body["answer"], "tokens": 8, "reason": "length"} and body["answer"].startswith("5")
    streamed = requests.post(store_server.url("/predictions/formatted"), timeout=120, stream=True,
                             json={"question": "1, 2, 3, 4,", "stream": True, "length": 5})
    lines = [json.loads(line) for line in streamed.iter_lines() if line]
    assert len(lines) == 5 and all(set(line) == {"partial"} for line in lines[:-1])
    assert lines[-1]["tokens"] == 5 and "".join(line["partial"] for line in lines[:-1]).strip().startswith("5")
    bad = post(store_server, "/predictions/formatted", {"no_question": True})
    assert bad.status_code == 424 and "question" in bad.json()["error"]
