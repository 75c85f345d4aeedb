"""generate / generate_stream with `requests` + `sseclient-py` (as Triton's own QA drives them, with no
Content-Type), the port of qa/L0_http/generate_endpoint_test.py to our LLM, raw binary requests,
and every class of error on the /v2 routes, each followed by proof that the server still serves."""

from __future__ import annotations

import gzip
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import sseclient

from server_process import wait_for

LLM = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
SSE = "text/event-stream; charset=utf-8"

pytestmark = pytest.mark.integration


def post(server, path, body, **kwargs):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url(path), data=data, timeout=120, **kwargs)


def generate(server, body, model=LLM):
    return post(server, f"/v2/models/{model}/generate", body)


def stream(server, body, model=LLM):
    return post(server, f"/v2/models/{model}/generate_stream", body, stream=True,
                headers={"Accept": "text/event-stream"})


def events(response):
    return [json.loads(event.data) for event in sseclient.SSEClient(response).events()]


def assert_error(response, status, message):
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert message in response.json()["error"], response.json()


def assert_still_serving(server):
    assert requests.get(server.url("/v2/health/live"), timeout=10).status_code == 200
    body = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}
    assert generate(server, body, "simple").json()["OUTPUT0"] == list(range(1, 17))


# --- generate_endpoint_test.py, ported ---------------------------------------------------------

def test_generate(default_server):
    response = generate(default_server, {"text_input": PROMPT, "max_tokens": 6})
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    body = response.json()
    assert isinstance(body["text_output"], str) and "Paris" in body["text_output"]
    assert body["model_name"] == LLM and body["model_version"] == "1"


def test_generate_with_all_inputs(default_server):
    body = {"text_input": [PROMPT], "max_tokens": 6, "temperature": 0, "top_p": 1, "top_k": 0, "stream": False,
            "sampling_parameters": "{}", "exclude_input_in_output": True, "stop_words": [""],
            "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
            "pad_id": 2, "end_id": 2}
    response = generate(default_server, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "Paris" in answer["text_output"] and answer["finish_reason"] in ("length", "stop")
    assert answer["num_input_tokens"] >= 5 and 1 <= answer["num_output_tokens"] <= 6


def test_request_id(default_server):
    assert generate(default_server, {"text_input": PROMPT, "max_tokens": 1, "id": "42"}).json()["id"] == "42"
    for body in ({"text_input": PROMPT, "max_tokens": 1}, {"text_input": PROMPT, "max_tokens": 1, "id": ""}):
        assert "id" not in generate(default_server, body).json()


def test_generate_stream_sends_data_frames_only(default_server):
    response = stream(default_server, {"text_input": [PROMPT], "stream": True, "max_tokens": 6})
    assert response.status_code == 200 and response.headers["Content-Type"] == SSE
    raw = response.content
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    frames = [frame for frame in raw.split(b"\n\n") if frame]
    assert all(frame.startswith(b"data: ") and b"\n" not in frame for frame in frames)
    assert b"[DONE]" not in raw
    assert all("text_output" in json.loads(frame[6:]) for frame in frames)


def test_generate_and_generate_stream_agree_for_greedy_decoding(default_server):
    body = {"text_input": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = generate(default_server, body).json()["text_output"]
    deltas = events(stream(default_server, body))
    assert len(deltas) > 1 and "".join(d["text_output"] for d in deltas) == whole
    one_event = events(stream(default_server, {**body, "stream": False}))  # vLLM parity: one full-text event
    assert [e["text_output"] for e in one_event] == [whole]
    assert generate(default_server, {**body, "stream": True}).json()["text_output"] == whole  # one response


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
@pytest.mark.parametrize("body, got", [({}, 0), ({"abc": 123}, 0), ({"max_tokens": 4}, 1),
                                       ({"stream": False, "other": "param"}, 1)])
def test_missing_inputs(default_server, path, body, got):
    response = post(default_server, f"/v2/models/{LLM}/{path}", body)
    assert_error(response, 400, f"expected number of inputs between 1 and 12 but got {got}")


@pytest.mark.parametrize("body, message", [
    ('{"text_input": 123, "max_tokens": 1}', "attempt to access JSON non-string as string"),
    ('{"text_input": "hi", "stream": "false"}', "attempt to access JSON non-boolean as boolean"),
    ('{"stream": "false", "text_input": 123}', "attempt to access JSON non-boolean as boolean"),
    ('{"text_input": "hi", "text_input": "again"}', "input 'text_input' already exists in request"),
    ('{"text_input": "hi", "stream": true, "stream": false, "text_input": "x"}', "input 'stream' already exists"),
    ('{"text_input": "hi", "PARAMS": {"a": 1}}', "parameter 'PARAMS' has invalid type"),
    ('{"text_input": {"a": 1}}', "attempt to access JSON non-string as string"),
    ('{"text_input": "hi", "parameters": 1}', "Expected JSON object for keyword: 'parameters'"),
    ('{"text_input": "hi", "parameters": {"nested": {"a": 1}}}',
     "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
    ('{"text_input": "hi", "max_tokens": 0}', "max_tokens"),
    ('{"text_input": "hi", "stream": true, "exclude_input_in_output": false}',
     "When streaming, `exclude_input_in_output` = False is not allowed."),
])
def test_invalid_bodies_fail_before_inference_as_json(default_server, body, message):
    assert_error(stream(default_server, body), 400, message)
    assert_still_serving(default_server)


def test_body_over_the_input_size_limit(default_server):  # default_server caps bodies at 100000 bytes
    response = generate(default_server, {"text_input": "x" * 150_000})
    assert_error(response, 400, " bytes exceeds the maximum allowed input size of ")
    assert_still_serving(default_server)


def test_parameters_work_like_top_level_keys(default_server):
    nested = generate(default_server, {"text_input": PROMPT, "parameters": {"max_tokens": 3, "temperature": 0}})
    top = generate(default_server, {"text_input": PROMPT, "max_tokens": 3, "temperature": 0})
    assert nested.status_code == 200 and nested.json() == top.json()


def test_zero_element_output(default_server):
    response = generate(default_server, {"INPUT0": [], "INPUT1": []}, "simple")
    assert response.status_code == 200 and response.json()["OUTPUT0"] == [] and response.json()["OUTPUT1"] == []


def test_concurrent_streams_all_succeed(default_server):
    def one(i):
        body = {"text_input": f"Count to {i}:", "max_tokens": 4, "stream": i % 2 == 0}
        response = stream(default_server, body)
        return response.status_code, events(response)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(status == 200 and frames and "error" not in frames[-1] for status, frames in results)


def test_closing_the_connection_during_streaming_cancels_generation(default_server):
    body = {"text_input": "Write a long story about a dragon.", "max_tokens": 3000,  # minutes if never cancelled
            "sampling_parameters": json.dumps({"ignore_eos": True})}
    response = stream(default_server, body)
    first = next(response.iter_lines())
    assert first.startswith(b"data: ")
    response.close()

    def engine_idle():
        described = requests.get(default_server.url(f"/models/{LLM}"), timeout=10).json()
        return described[0]["models"][0]["engine"]["running"] == 0

    wait_for(engine_idle, timeout=30)
    assert_still_serving(default_server)


# --- raw binary and /infer errors with plain requests -------------------------------------------

def test_raw_binary_requests(default_server):
    response = post(default_server, f"/v2/models/{LLM}/infer", PROMPT.encode(),
                    headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/octet-stream"
    ihcl = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:ihcl])
    assert header["outputs"][0]["name"] == "text_output"
    (length,) = struct.unpack("<I", response.content[ihcl:ihcl + 4])
    assert b"Paris" in response.content[ihcl + 4:ihcl + 4 + length]
    embedded = post(default_server, "/v2/models/all-minilm-l6-v2/infer", b"a cat",
                    headers={"Inference-Header-Content-Length": "0"})
    ihcl = int(embedded.headers["Inference-Header-Content-Length"])
    assert np.frombuffer(embedded.content[ihcl:], dtype="<f4").shape == (384,)
    refused = post(default_server, "/v2/models/simple/infer", b"\0" * 128, headers={"Inference-Header-Content-Length": "0"})
    assert_error(refused, 400, "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple'")


SIMPLE_JSON = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                          {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}


def simple_with(**changes):
    body = json.loads(json.dumps(SIMPLE_JSON))
    body["inputs"][1].update(changes)
    return body


@pytest.mark.parametrize("body, headers, status, message", [
    (simple_with(data=list(range(15))), {}, 400, "Failed to parse 'data' field: shape does not match true shape"),
    (simple_with(data=list(range(18))), {}, 400, "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    (simple_with(datatype="FP16"), {}, 400, "receiving FP16 data via JSON is not supported"),
    (simple_with(data=None, parameters={"binary_data_size": 60}), {}, 400, "Input must set only one of"),
    ({**SIMPLE_JSON, "parameters": {"triton_x": 1}}, {}, 400, "parameter keys starting with 'triton_' are reserved"),
    ({**SIMPLE_JSON, "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]}, {}, 400,
     "output 'OUTPUT0' already exists in request"),
    ({**SIMPLE_JSON, "outputs": [{"name": "OUTPUT7"}]}, {}, 400, "unexpected inference output 'OUTPUT7'"),
    (SIMPLE_JSON, {"Inference-Header-Content-Length": "99999999999"}, 400,
     "Unable to parse Inference-Header-Content-Length, got: 99999999999"),
    (SIMPLE_JSON, {"Content-Encoding": "br"}, 501, "Unsupported compression type"),
    ("[" * 120 + "]" * 120, {}, 400, "JSON nesting depth exceeds maximum allowed limit (100)"),
    ("{not json", {}, 400, "failed to parse the request JSON buffer"),
])
def test_infer_errors_use_tritons_messages_and_do_not_poison_the_server(default_server, body, headers, status,
                                                                        message):
    response = post(default_server, "/v2/models/simple/infer", body, headers=headers)
    assert_error(response, status, message)
    if status == 501:
        assert response.headers["Accept-Encoding"] == "gzip, deflate"
    good = post(default_server, "/v2/models/simple/infer", SIMPLE_JSON)
    assert good.status_code == 200 and good.json()["outputs"][0]["data"] == list(range(1, 17))


def test_a_form_content_type_is_ignored(default_server):  # what `curl -d` sends, as in Triton's test.sh
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    response = post(default_server, "/v2/models/simple/infer", SIMPLE_JSON, headers=form)
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))
    answer = post(default_server, f"/v2/models/{LLM}/generate", {"text_input": PROMPT, "max_tokens": 3}, headers=form)
    assert answer.status_code == 200 and "Paris" in answer.json()["text_output"]


def test_binary_size_errors(default_server):
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16},
                                    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32",
                                     "parameters": {"binary_data_size": 40}}]}).encode()
    response = post(default_server, "/v2/models/simple/infer", header + b"\0" * 40,
                    headers={"Inference-Header-Content-Length": str(len(header))})
    assert_error(response, 400, "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 40")
    response = post(default_server, "/v2/models/simple/infer", header + b"\0" * 30,
                    headers={"Inference-Header-Content-Length": str(len(header))})
    assert_error(response, 400, "unexpected size for input 'INPUT1', expecting 10 additional bytes for model 'simple'")


def test_compressed_requests_with_plain_requests(default_server):
    body = gzip.compress(json.dumps(SIMPLE_JSON).encode())
    response = post(default_server, "/v2/models/simple/infer", body, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200 and response.headers["Content-Encoding"] == "gzip"  # requests asks for it
    assert response.json()["outputs"][1]["data"] == list(range(-1, 15))
    assert_error(post(default_server, f"/v2/models/{LLM}/generate", body, headers={"Content-Encoding": "gzip"}), 400,
                 "Unsupported content-encoding, only 'identity' is supported.")


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v2/nothing", 404, "Not Found"),
    ("GET", "/v2/", 404, "Not Found"),
    ("GET", "/v2/models/simple/versions/abc", 404, "Not Found"),
    ("GET", "/v2/models/simple/infer", 405, "Method Not Allowed"),
    ("DELETE", "/v2/models/simple", 405, "Method Not Allowed"),
    ("POST", "/v2/models/nope/infer", 404, "Request for unknown model: 'nope' is not found"),
    ("POST", "/v2/models/simple/versions/2/infer", 404, "Request for unknown model: 'simple' version 2 is not found"),
    ("POST", "/v2/repository/other/models/simple/load", 501, "'repository_name' specification is not supported"),
])
def test_routing_errors_are_json(default_server, method, path, status, message):
    response = requests.request(method, default_server.url(path), timeout=10)
    assert response.status_code == status and response.json() == {"error": message}


def test_health_and_repository_index_with_plain_requests(default_server):
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{LLM}/ready", f"/v2/models/{LLM}/versions/1/ready"):
        response = requests.get(default_server.url(path + "?test_1=1&test_2=2"), timeout=10)  # the query is ignored
        assert response.status_code == 200 and response.content == b""
    index = post(default_server, "/v2/repository/index", b"")
    assert index.status_code == 200 and len(index.json()) == 3
    assert len(post(default_server, "/v2/repository/index", {"ready": True}).json()) == 3
    assert_error(post(default_server, "/v2/repository/index", {"ready": "yes"}), 400,
                 "Invalid value for 'ready': expected a boolean")
    assert_error(post(default_server, "/v2/repository/index", "[" * 200 + "]" * 200), 400, "nesting depth")
    assert_still_serving(default_server)
