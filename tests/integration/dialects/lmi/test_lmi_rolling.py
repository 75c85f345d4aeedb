"""The rolling batch through the LMI schema: the default model (rolling_batch=auto), plus the
store's `faulty` model (fault injection, 2 rows, queue of 2, predict_timeout 6 s) and `tgi`
(option.tgi_compat=true)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from server_process import wait_for
from server_probes import PROMPTS, OpenStream, both_rows_busy, engine_stats, token_ids
from text_generation.types import Response as TgiResponse
from text_generation.types import StreamResponse

pytestmark = pytest.mark.integration

def generate(server, body, path="/invocations", **kwargs):
    return requests.post(server.url(path), json=body, timeout=180, **kwargs)


def greedy(prompt, max_new_tokens):
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}


def jsonlines(response):
    return [json.loads(line) for line in response.iter_lines() if line]


def test_greedy_outputs_are_identical_alone_and_concurrently(default_server):
    bodies = [greedy(p, 6 + 4 * (i % 4)) for i, p in enumerate(PROMPTS)]
    alone = [generate(default_server, b).json() for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: generate(default_server, b).json(), bodies))
    for a, t in zip(alone, together):
        assert t["generated_text"] == a["generated_text"]
        assert token_ids(t) == token_ids(a)
    assert engine_stats(default_server, "smollm2-135m-instruct")["largestBatch"] > 1


def test_seeded_sample_is_identical_alone_and_in_company(default_server):
    # Seed 1234 drew its third token within float noise of a CDF boundary on an AVX2-only EPYC: the
    # last-bit differences a batch's shape makes in the logits decided the draw (4 of 5 runs, before
    # and after the fast-engine work). Any seed can meet such a knife edge; this one does not here.
    sampled = {"inputs": "Once upon a time", "parameters": {"do_sample": True, "seed": 4321, "temperature": 0.9,
                                                            "top_p": 0.95, "max_new_tokens": 24, "details": True}}
    alone = generate(default_server, sampled).json()
    with ThreadPoolExecutor(6) as pool:
        company = [pool.submit(generate, default_server, greedy(p, 20)) for p in PROMPTS[:5]]
        together = pool.submit(generate, default_server, sampled)
        result = together.result().json()
        # Same tokens; logprobs may differ in the last float digits with the batch's shape.
        assert result["generated_text"] == alone["generated_text"] and token_ids(result) == token_ids(alone)
        assert all(f.result().status_code == 200 for f in company)


def test_stop_sequences_end_generation(default_server):
    body = {"inputs": "The capital of France is", "parameters": {"stop_sequences": ["."], "details": True}}
    cut = generate(default_server, body).json()
    assert cut["generated_text"] == " Paris"
    assert cut["details"]["finish_reason"] == "stop_sequence"
    body["parameters"]["include_stop_str_in_output"] = True
    assert generate(default_server, body).json()["generated_text"] == " Paris."


@pytest.mark.parametrize("prompt", ["Emoji list: 🚀🎉🔥😀🌍", "Japanese words: 東京, 大阪, 京都,",
                                    "Café, naïve, résumé, crème brûlée, jalapeño,"])
def test_stream_equals_non_stream_with_multibyte_text(default_server, prompt):
    parameters = {"max_new_tokens": 24}
    whole = generate(default_server, {"inputs": prompt, "parameters": parameters}).json()["generated_text"]
    streamed = generate(default_server, {"inputs": prompt, "parameters": parameters, "stream": True}, stream=True)
    lines = jsonlines(streamed)
    assert "".join(line["token"]["text"] for line in lines) == whole
    assert lines[-1]["generated_text"] == whole
    assert "\ufffd" not in whole and any(ord(c) > 127 for c in whole + prompt)


def test_details_prefill_and_top_tokens(default_server):
    prompt = "The capital of France is"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 5, "details": True, "decoder_input_details": True,
                                             "top_n_tokens": 3}}
    details = generate(default_server, body).json()["details"]
    assert details["finish_reason"] in {"length", "eos_token", "stop_sequence"}
    assert details["generated_tokens"] == len(details["tokens"]) == len(details["top_tokens"])
    assert details["inputs"] == prompt
    prefill = details["prefill"]
    counted = requests.post(default_server.url("/generate"), timeout=60,
                            json={"inputs": prompt, "parameters": {"max_new_tokens": 1}})
    assert len(prefill) == int(counted.headers["x-prompt-tokens"]) > 1
    assert prefill[0]["log_prob"] is None and all(isinstance(t["log_prob"], float) for t in prefill[1:])
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert set(token) >= {"id", "text", "log_prob"}
        assert len(top) == 3 and top[0]["log_prob"] >= top[1]["log_prob"] >= top[2]["log_prob"]
        assert token["id"] == top[0]["id"]  # greedy picks the most likely token


def test_return_full_text_and_n_best_of(default_server):
    full = generate(default_server, {"inputs": "Water boils at",
                                     "parameters": {"max_new_tokens": 4, "return_full_text": True}}).json()
    assert full["generated_text"].startswith("Water boils at")
    several = generate(default_server, {"inputs": "Once upon a time", "parameters": {
        "n": 3, "do_sample": True, "seed": 7, "max_new_tokens": 8, "details": True}}).json()
    others = several["details"]["best_of_sequences"]
    assert len(others) == 2
    assert all(set(o) >= {"generated_text", "finish_reason", "generated_tokens", "tokens"} for o in others)


def test_json_formatter_framing(default_server):
    response = generate(default_server, {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert response.headers["Content-Type"] == "application/json"
    assert set(response.json()) == {"generated_text"}


def test_jsonlines_formatter_framing(default_server):
    response = generate(default_server, {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True},
                                         "stream": True}, stream=True)
    assert response.headers["Content-Type"] == "application/jsonlines"
    lines = jsonlines(response)
    assert len(lines) == 4
    assert all(set(line) == {"token"} for line in lines[:-1])
    assert set(lines[-1]) == {"token", "generated_text", "details"}
    assert set(lines[-1]["details"]) == {"finish_reason", "generated_tokens", "inputs"}


def test_sse_formatter_framing(default_server):
    response = generate(default_server, {"inputs": "Hello", "parameters": {"max_new_tokens": 4,
                                                                           "output_formatter": "sse"}}, stream=True)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and len(events) == 5
    frames = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(f["token"]["text"] for f in frames) == frames[-1]["generated_text"]


def test_tgi_compat_bodies_parse_with_the_tgi_client_models(store_server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 5}}
    whole = generate(store_server, body, path="/predictions/tgi")
    assert whole.status_code == 200 and whole.headers["Content-Type"] == "application/json"
    parsed = TgiResponse(**whole.json()[0])
    assert parsed.details.generated_tokens == 5 and parsed.details.prefill == []
    stream = generate(store_server, {**body, "stream": True}, path="/predictions/tgi", stream=True)
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    frames = [StreamResponse(**json.loads(line[len("data:"):])) for line in stream.iter_lines(decode_unicode=True)
              if line.startswith("data:")]
    assert len(frames) == 5 and frames[-1].generated_text == parsed.generated_text
    assert all(f.generated_text is None for f in frames[:-1])
    bad = generate(store_server, {"inputs": ""}, path="/predictions/tgi")
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


@pytest.mark.parametrize("payload, fragment", [
    ({"inputs": ["a", "b"]}, "not a list"),
    ({"inputs": ""}, "must not be empty"),
    ({"parameters": {}}, "inputs"),
    ({"inputs": "x", "parameters": {"top_p": 0}}, "top_p"),
    ({"inputs": "x", "parameters": {"no_such_knob": 1}}, "no_such_knob"),
    ({"inputs": "x", "parameters": []}, "parameters"),
    ({"inputs": "x", "stream": "yes"}, "stream"),
    ({"inputs": "x", "parameters": {"n": 2}}, "sampling"),
])
def test_rolling_validation_errors_use_the_spec_shape(default_server, payload, fragment):
    response = generate(default_server, payload)
    assert response.status_code == 424
    body = response.json()
    assert set(body) == {"error", "code"} and body["code"] == 424 and fragment in body["error"]


def post_raw(server, body: str, path="/invocations"):
    """POST this exact JSON text (json.dumps cannot write 1e400, nor nesting this deep)."""
    return requests.post(server.url(path), data=body.encode(), timeout=60,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body, fragment", [
    ('{"inputs": "\\ud800"}', "surrogate"),
    ('{"inputs": "x", "parameters": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}", "nested"),
    ('{"inputs": "x", "parameters": {"top_k": %d}}' % 2**63, "top_k"),
    ('{"inputs": "x", "parameters": {"seed": %d}}' % 2**63, "seed"),
    ('{"inputs": "x", "parameters": {"stop_token_ids": [%d]}}' % 2**63, "stop_token_ids"),
    ('{"inputs": "x", "parameters": {"temperature": 1e400}}', "temperature"),
])
def test_bodies_the_engine_cannot_take_get_the_spec_error(default_server, body, fragment):
    response = post_raw(default_server, body)
    assert response.status_code == 424
    assert set(response.json()) == {"error", "code"} and fragment in response.json()["error"]


def test_parameters_given_as_strings_are_coerced(default_server):
    as_strings = generate(default_server, {"inputs": "Once upon a time", "parameters": {
        "max_new_tokens": "4", "top_k": "5", "temperature": "0.5", "seed": "11"}})
    as_numbers = generate(default_server, {"inputs": "Once upon a time", "parameters": {
        "max_new_tokens": 4, "top_k": 5, "temperature": 0.5, "seed": 11}})
    assert as_strings.status_code == 200 and as_strings.json() == as_numbers.json()


def test_abandoned_streams_free_their_slots(store_server):
    with both_rows_busy(store_server) as streams:
        for s in streams:
            s.close()
        wait_for(lambda: engine_stats(store_server, "faulty")["running"] == 0)
        assert generate(store_server, greedy("Hello", 3), path="/predictions/faulty").status_code == 200


def test_full_queue_gives_503_and_tgi_429_then_recovers(store_server):
    with both_rows_busy(store_server) as running, ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(generate, store_server, greedy(p, 2), path="/predictions/faulty")
                   for p in ("Hi", "Hey")]
        wait_for(lambda: engine_stats(store_server, "faulty")["waiting"] == 2)
        refused = generate(store_server, greedy("Hello", 2), path="/predictions/faulty")
        assert refused.status_code == 503
        assert refused.json()["type"] == "WlmCapacityException"
        overloaded = requests.post(store_server.url("/generate"), params={"model_name": "faulty"}, timeout=30,
                                   json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        assert overloaded.status_code == 429
        assert overloaded.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        for s in running:
            s.close()
        for future in waiting:  # admitted once the streams went away, or timed out cleanly before
            result = future.result()
            assert result.status_code == 200 or result.json()["type"] == "TimeoutException"
    assert generate(store_server, greedy("Hello", 2), path="/predictions/faulty").status_code == 200


def test_waiting_past_predict_timeout_fails_cleanly(store_server):
    with both_rows_busy(store_server):
        late = generate(store_server, greedy("Hello", 2), path="/predictions/faulty")
    assert late.status_code == 504
    assert late.json()["type"] == "TimeoutException" and "predict_timeout" in late.json()["message"]


def test_an_injected_fault_fails_only_its_request_and_the_engine_recovers(store_server):
    """`faulty` raises in any prefill whose prompt has "xylophone" (2 rows, queue of 2)."""
    poisoned = greedy("Play the xylophone please", 6)
    running = OpenStream(store_server, "Once upon a time")
    try:
        failed = generate(store_server, poisoned, path="/predictions/faulty")
        assert failed.status_code == 424 and "injected fault" in failed.json()["error"]
        more = [json.loads(next(running.lines)) for _ in range(5)]  # the running stream never noticed
        assert all("token" in line and "error" not in line for line in more)
    finally:
        running.close()
    wait_for(lambda: engine_stats(store_server, "faulty")["running"] == 0)
    with ThreadPoolExecutor(2) as pool:  # prefilled together, then each alone after the fault
        healthy, bad = pool.map(lambda b: generate(store_server, b, path="/predictions/faulty"),
                                [greedy("The capital of France is", 6), poisoned])
    assert healthy.status_code == 200 and "Paris" in healthy.json()["generated_text"]
    assert bad.status_code == 424
    streamed = generate(store_server, {**poisoned, "stream": True}, path="/predictions/faulty")
    assert streamed.status_code == 424 and "injected fault" in streamed.json()["error"]
    assert engine_stats(store_server, "faulty")["failedSteps"] >= 3
    assert generate(store_server, greedy("Hello", 3), path="/predictions/faulty").status_code == 200
    assert requests.get(store_server.url("/ping"), timeout=10).status_code == 200


def test_num_beams_returns_the_other_beams(default_server):
    body = {"inputs": "The capital of France is", "parameters": {"num_beams": 3, "max_new_tokens": 8,
                                                                 "details": True}}
    response = generate(default_server, body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert "Paris" in result["generated_text"]
    others = result["details"]["best_of_sequences"]
    assert len(others) == 2 and len({o["generated_text"] for o in others} | {result["generated_text"]}) == 3
    refused = generate(default_server, {**body, "stream": True})
    assert refused.status_code == 424 and "num_beams" in refused.json()["error"]
