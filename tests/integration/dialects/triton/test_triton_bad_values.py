"""Values that once answered 500 on the Triton routes of the real server (issue 9): lone surrogates,
text tensors that are not UTF-8, a tensor model's missing input, and integers beyond int64. Each is
now a 400 in Triton's shape (LMI's on /predictions), nothing reaches the log as a traceback, and the
server goes on serving."""

from __future__ import annotations

import json
import struct

import pytest
import requests

LLM = "smollm2-135m-instruct"
EMBEDDING = "all-minilm-l6-v2"

pytestmark = pytest.mark.integration


def post(server, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(server.url(path), data=data, headers=headers or {}, timeout=120)


def assert_triton_error(response, message):
    assert response.status_code == 400, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert message in response.json()["error"], response.json()


def assert_still_serving(server):
    body = {"text_input": "Hello", "max_tokens": 2}
    assert post(server, f"/v2/models/{LLM}/generate", body).json()["text_output"]
    body = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}
    assert post(server, "/v2/models/simple/generate", body).json()["OUTPUT0"] == list(range(1, 17))


def binary_text_request(text: bytes) -> tuple[bytes, dict]:
    element = struct.pack("<I", len(text)) + text
    header = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(element)}}]}).encode()
    return header + element, {"Inference-Header-Content-Length": str(len(header))}


@pytest.mark.parametrize("path", [f"/v2/models/{LLM}/generate", f"/v2/models/{LLM}/generate_stream",
                                  f"/v2/models/{LLM}/infer", f"/v2/models/{EMBEDDING}/infer",
                                  "/v2/models/simple/infer", "/v2/models/simple/generate"])
def test_a_lone_surrogate_is_a_400_on_every_route(default_server, path):
    if path.endswith("/infer"):
        name = "INPUT0" if "simple" in path else "text_input"
        body = b'{"inputs": [{"name": "%s", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}' % name.encode()
    else:
        body = b'{"text_input": "\\ud800", "INPUT0": "\\ud800", "max_tokens": 2}'
    assert_triton_error(post(default_server, path, body), "lone UTF-16 surrogate")
    assert_still_serving(default_server)


@pytest.mark.parametrize("model", [LLM, EMBEDDING])
def test_binary_text_that_is_not_utf8_is_a_400_naming_the_input(default_server, model):
    body, headers = binary_text_request(b"\xed\xa0\x80 \xff")  # an encoded surrogate, then a stray byte
    assert_triton_error(post(default_server, f"/v2/models/{model}/infer", body, headers),
                        "input 'text_input' must be UTF-8 text")


def test_a_tensor_model_without_its_input_is_a_400_and_no_traceback(default_server):
    response = post(default_server, "/predictions/simple", {"inputs": [1, 2]})
    assert response.status_code == 400 and "input tensor 'INPUT0' is missing" in response.json()["error"]
    response = post(default_server, "/predictions/simple?INPUT0=1", b"")
    assert response.status_code == 400 and "content entry 'INPUT0' is not a tensor" in response.json()["error"]
    assert_still_serving(default_server)
    assert "KeyError" not in default_server.output() and "handler failed" not in default_server.output()


@pytest.mark.parametrize("body, messages", [  # messages: (on /generate, on /infer)
    ({"text_input": "Hi", "max_tokens": 2, "seed": 2**64}, ("parameter 'seed' has invalid type",) * 2),
    ({"text_input": "Hi", "max_tokens": 2, "seed": -1}, ("invalid sampling parameter: seed",) * 2),
    ({"text_input": "Hi", "max_tokens": 2, "seed": "18446744073709551616"}, ("invalid sampling parameter: seed",) * 2),
    # top_k is an INT32 input of the LLM: on /generate the key becomes that tensor
    ({"text_input": "Hi", "max_tokens": 2, "parameters": {"top_k": 2**63}},
     ("a value of input 'top_k' is out of range for INT32", "parameter 'top_k' has invalid type")),
    ({"text_input": "Hi", "max_tokens": 2, "top_k": "9223372036854775808"},
     ("attempt to access JSON non-signed-integer as signed integer", "top_k: Input should be less than or equal to 2147483647")),
    ({"text_input": "Hi", "max_tokens": 2, "sampling_parameters": json.dumps({"top_k": 2**63})},
     ("top_k: Input should be less than or equal to 2147483647",) * 2),
    ({"text_input": "Hi", "max_tokens": 2**31}, ("out of range for INT32",) * 2),
])
@pytest.mark.parametrize("route", ["generate", "infer"])
def test_integers_beyond_what_the_engine_takes_are_a_400(default_server, body, messages, route):
    if route == "infer":  # the same values as /infer request parameters or tensors
        tensors = {k: v for k, v in body.items() if k in ("text_input", "max_tokens", "sampling_parameters")}
        parameters = {k: v for k, v in body.items() if k not in tensors and k != "parameters"}
        parameters.update(body.get("parameters", {}))
        datatypes = {"text_input": "BYTES", "max_tokens": "INT32", "sampling_parameters": "BYTES"}
        body = {"parameters": parameters, "inputs": [{"name": k, "shape": [1], "datatype": datatypes[k], "data": [v]}
                                                     for k, v in tensors.items()]}
    message = messages[0] if route == "generate" else messages[1]
    assert_triton_error(post(default_server, f"/v2/models/{LLM}/{route}", body), message)
