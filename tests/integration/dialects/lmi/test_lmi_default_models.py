"""The embedded defaults over HTTP: SmolLM2-135M-Instruct (rolling batch) and MiniLM embeddings."""

from __future__ import annotations

import math
import uuid

import pytest
import requests

TEXT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
TENSOR_MODEL = "simple"  # Triton's example model (a model.py tensor model), served on the /v2 routes

pytestmark = pytest.mark.integration


def generate(server, body, path="/invocations", **kwargs):
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def assert_lmi_error(response, status, error_type=None):
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["code"] == status
    if error_type:
        assert body["type"] == error_type
    return body


def assert_still_serving(server):
    assert requests.get(server.url("/ping"), timeout=10).status_code == 200
    response = generate(server, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200 and isinstance(response.json()["generated_text"], str)


def test_ping_reports_each_model_healthy(default_server):
    response = requests.get(default_server.url("/ping"), timeout=10)
    assert response.status_code == 200
    assert response.json() == {TEXT_MODEL: {"status": "Healthy"}, EMBEDDING_MODEL: {"status": "Healthy"},
                               TENSOR_MODEL: {"status": "Healthy"}}


def test_models_listing_and_description(default_server):
    models = requests.get(default_server.url("/models"), timeout=10).json()["models"]
    assert {m["modelName"]: m["status"] for m in models} == {TEXT_MODEL: "Healthy", EMBEDDING_MODEL: "Healthy",
                                                             TENSOR_MODEL: "Healthy"}
    described = requests.get(default_server.url(f"/models/{TEXT_MODEL}"), timeout=10).json()
    assert described[0]["workflowName"] == TEXT_MODEL
    entry = described[0]["models"][0]
    assert entry["modelName"] == TEXT_MODEL and entry["status"] == "Healthy"
    assert entry["task"] == "text-generation" and entry["rollingBatch"] is True
    assert entry["engine"]["maxBatchSize"] == 32
    phases = {"admit", "prefill", "decode", "sample", "emit", "deliver", "evict"}
    assert set(entry["engine"]["phaseSeconds"]) == set(entry["engine"]["phaseCounts"]) == phases
    # what runs the forward here (kernels/plan.py): the steps in their order, every registry kernel reported
    kernels = entry["engine"]["kernels"]
    assert [step["name"] for step in kernels["steps"]][-1] == "decode_attention"
    assert set(kernels["kernels"]) >= {"row", "decode_attention", "column_copy"} and "bf16" in kernels["host"]
    embedding = requests.get(default_server.url(f"/models/{EMBEDDING_MODEL}"), timeout=10).json()[0]["models"][0]
    assert "decode_attention" not in [step["name"] for step in embedding["kernels"]["steps"]]
    # the worker's resident memory and this model's parts of it (serving/memory_report.py): SmolLM2-135M's
    # ~135M weights in fp32 (the GGUF dequantized), its row-kernel copies, the prefix cache within its bound
    memory = entry["memory"]
    assert 135e6 * 4 * 0.9 < memory["weightsBytes"] < 135e6 * 4 * 1.5
    assert memory["workerResidentBytes"] > memory["weightsBytes"] + memory["rowKernelCopiesBytes"]
    assert memory["kvCacheBytes"] >= 0 and memory["prefixCacheBudgetBytes"] == 512 * 2**20
    assert 0 <= memory["prefixCacheBytes"] <= memory["prefixCacheBudgetBytes"]
    assert embedding["memory"]["weightsBytes"] > 0 and "kvCacheBytes" not in embedding["memory"]


def test_greedy_capital_of_france(default_server):
    response = generate(default_server, {"inputs": "The capital of France is"})
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    assert "Paris" in response.json()["generated_text"]


def test_predictions_route_equals_invocations(default_server):
    body = {"inputs": "Water boils at", "parameters": {"max_new_tokens": 12}}
    via_invocations = generate(default_server, body).json()
    assert generate(default_server, body, path=f"/predictions/{TEXT_MODEL}").json() == via_invocations
    assert generate(default_server, body, path=f"/predictions/{TEXT_MODEL}/1").json() == via_invocations


def test_invocations_model_name_selects_the_embedding_model(default_server):
    response = generate(default_server, {"inputs": "hello"}, params={"model_name": EMBEDDING_MODEL})
    assert response.status_code == 200
    vectors = response.json()
    assert len(vectors) == 1 and len(vectors[0]) == 384


def test_text_plain_body_is_the_prompt(default_server):
    response = requests.post(default_server.url("/invocations"), data="The capital of France is",
                             headers={"Content-Type": "text/plain"}, timeout=60)
    assert response.status_code == 200
    assert "Paris" in response.json()["generated_text"]


def test_http_errors_are_json_and_the_server_keeps_serving(default_server):
    assert_lmi_error(generate(default_server, {"inputs": "x"}, path="/predictions/no-such-model"), 404,
                     "ModelNotFoundException")
    assert_lmi_error(generate(default_server, {"inputs": "x"}, params={"model_name": "nope"}), 404)
    assert_lmi_error(requests.get(default_server.url("/invocations"), timeout=10), 405)
    assert_lmi_error(requests.get(default_server.url("/no/such/route"), timeout=10), 404)
    oversized = requests.post(default_server.url("/invocations"), data=b"x" * 150_000, timeout=30)
    assert "maximum request size of 100000" in assert_lmi_error(oversized, 413)["message"]
    assert_still_serving(default_server)


def test_request_id_is_echoed_or_generated(default_server):
    sent = "test-" + uuid.uuid4().hex
    echoed = requests.get(default_server.url("/ping"), headers={"x-request-id": sent}, timeout=10)
    assert echoed.headers["x-request-id"] == sent
    generated = requests.get(default_server.url("/ping"), timeout=10).headers["x-request-id"]
    assert str(uuid.UUID(generated)) == generated


def _cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embedding_model_returns_normalised_vectors(default_server):
    texts = ["A cat sits on the mat.", "A kitten is sitting on a rug.", "Quarterly revenue beat expectations."]
    response = generate(default_server, {"inputs": texts}, path=f"/predictions/{EMBEDDING_MODEL}")
    assert response.status_code == 200
    vectors = response.json()
    assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2]) + 0.2
    single = generate(default_server, {"inputs": texts[0]}, path=f"/predictions/{EMBEDDING_MODEL}").json()
    assert len(single) == 1 and _cosine(single[0], vectors[0]) > 0.9999
