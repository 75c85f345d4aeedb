"""The dynamic-batch schema (rolling_batch=disable): the store's `dynamic` model (batch_size 4,
20 ms window), `batched` (3 s window, to observe batching) and `streaming` (legacy streaming)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.integration


def generate(server, body, path="/predictions/dynamic", **kwargs):
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def batch_stats(server, model):
    return requests.get(server.url(f"/models/{model}"), timeout=10).json()[0]["models"][0]["batchStats"]


def test_list_inputs_match_single_requests(store_server):
    prompts = ["The capital of France is", "One, two, three,", "My favourite colour is"]
    parameters = {"max_new_tokens": 10}
    batched = generate(store_server, {"inputs": prompts, "parameters": parameters}).json()
    assert len(batched) == len(prompts)
    for prompt, result in zip(prompts, batched):
        alone = generate(store_server, {"inputs": prompt, "parameters": parameters}).json()
        assert result == alone[0]


def test_generation_parameters_are_honoured(store_server):
    short = generate(store_server, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 1}}).json()
    longer = generate(store_server, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 20}}).json()
    assert 0 < len(short[0]["generated_text"]) < len(longer[0]["generated_text"])
    assert longer[0]["generated_text"].startswith(short[0]["generated_text"])

    full = generate(store_server, {"inputs": "The capital of France is",
                                     "parameters": {"max_new_tokens": 5, "return_full_text": True}}).json()
    assert full[0]["generated_text"].startswith("The capital of France is")

    stopped = generate(store_server, {"inputs": "The capital of France is",
                                        "parameters": {"stop_sequences": ["Paris"]}}).json()
    assert "Paris" not in stopped[0]["generated_text"]


def test_seeded_sampling_is_reproducible(store_server):
    body = {"inputs": "Once upon a time", "parameters": {"do_sample": True, "seed": 42, "temperature": 1.2,
                                                         "top_k": 50, "max_new_tokens": 20}}
    first = generate(store_server, body).json()
    assert generate(store_server, body).json() == first
    other_seeds = {generate(store_server, {**body, "parameters": {**body["parameters"], "seed": s}}).json()[0][
        "generated_text"] for s in (1, 2, 3)}
    assert len(other_seeds | {first[0]["generated_text"]}) > 1


@pytest.mark.parametrize("payload, fragment", [
    (b'{"inputs": ', "not valid JSON"),
    (json.dumps({"parameters": {}}).encode(), "inputs"),
    (json.dumps({"inputs": ""}).encode(), "inputs"),
    (json.dumps({"inputs": "hi", "parameters": {"details": True}}).encode(), "details"),
    (json.dumps({"inputs": "hi", "parameters": {"temperature": -1}}).encode(), "temperature"),
    (json.dumps({"inputs": "hi", "parameters": {"top_p": 1.5}}).encode(), "top_p"),
    (json.dumps({"inputs": "hi", "stream": True}).encode(), "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "rolling batch"),
])
def test_bad_payloads_fail_with_424_and_a_message(store_server, payload, fragment):
    response = requests.post(store_server.url("/predictions/dynamic"), data=payload,
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 424
    body = response.json()
    assert body["code"] == 424 and body["message"] == "invoke handler failure"
    assert fragment in body["error"]


def test_concurrent_requests_share_one_batched_forward(store_server):
    bodies = [
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}},
        {"inputs": "One, two, three,", "parameters": {"max_new_tokens": 12}},
        {"inputs": "Once upon a time", "parameters": {"do_sample": True, "seed": 3, "max_new_tokens": 8}},
        {"inputs": ["Red, green,", "Monday, Tuesday,"], "parameters": {"repetition_penalty": 1.3}},
    ]
    before = batch_stats(store_server, "batched")
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: generate(store_server, b, path="/predictions/batched"), bodies))
    after = batch_stats(store_server, "batched")
    assert [r.status_code for r in responses] == [200] * 4
    assert after["batches"] == before["batches"] + 1
    assert after["lastBatchSize"] == 4 and after["largestBatch"] == 4
    assert "Paris" in responses[0].json()[0]["generated_text"]
    assert len(responses[3].json()) == 2
    # The same greedy request alone gives the same text as it did in company.
    alone = generate(store_server, bodies[1], path="/predictions/batched")
    assert alone.json() == responses[1].json()


def test_a_bad_request_fails_alone_inside_a_batch(store_server):
    bodies = [{"inputs": f"Count to {n}:", "parameters": {"max_new_tokens": 4}} for n in (2, 3, 4)]
    bodies.insert(1, {"inputs": "x", "parameters": {"top_k": -1}})
    before = batch_stats(store_server, "batched")
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: generate(store_server, b, path="/predictions/batched"), bodies))
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
    whole = generate(store_server, body).json()[0]["generated_text"]
    assert streamed == whole
