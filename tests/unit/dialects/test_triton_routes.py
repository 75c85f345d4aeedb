"""The /v2 routes through Flask's test client on an app serving only `simple` (no language model):
bad bodies of every kind answer Triton's status and `{"error": ...}`, never a 500."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService

SIMPLE_BODY = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}


@pytest.fixture(scope="module")
def client():
    config = build_server_config({"HOME": "/tmp"}, default_store=DEFAULT_STORE)
    simple = next(model for model in config.models if model.name == "simple")
    config = config.model_copy(update={"models": (simple,)})
    service = ModelService(simple, config.cache_dir)
    service.load()  # model.py only: no weights
    return create_app(config, ModelRegistry([service])).test_client()


def assert_error(response, status, message):
    assert response.status_code == status, response.data
    assert response.mimetype == "application/json"
    assert message in response.get_json()["error"], response.get_json()


def assert_still_serving(client):
    assert client.post("/v2/models/simple/generate", data=json.dumps(SIMPLE_BODY)).get_json()["OUTPUT0"] == \
        list(range(1, 17))


@pytest.mark.parametrize("path, body", [
    ("/v2/models/simple/generate", b'{"INPUT0": "\\ud800"}'),
    ("/v2/models/simple/generate", b'{"INPUT0": [1], "note": "\\udfff"}'),
    ("/v2/models/simple/infer", b'{"inputs": [{"name": "\\ud800", "shape": [1], "datatype": "INT32", "data": [1]}]}'),
    ("/v2/models/simple/infer", b'{"id": "\\ud800", "inputs": []}'),
    ("/v2/repository/index", b'{"ready": "\\ud800"}'),
])
def test_lone_surrogates_are_a_400(client, path, body):
    assert_error(client.post(path, data=body), 400, "lone UTF-16 surrogate")
    assert_still_serving(client)


@pytest.mark.parametrize("body", [b'{"INPUT0": NaN}', b'{"INPUT0": [Infinity]}'])
def test_non_json_numbers_are_a_400(client, body):
    assert_error(client.post("/v2/models/simple/generate", data=body), 400, "is not a valid JSON value")


def test_nesting_over_100_levels_keeps_tritons_message(client):
    body = b'{"inputs": ' + b"[" * 120 + b"]" * 120 + b"}"
    assert_error(client.post("/v2/models/simple/infer", data=body), 400,
                 "JSON nesting depth exceeds maximum allowed limit (100)")


@pytest.mark.parametrize("depth", [120, 5_000])
def test_a_deeply_nested_ready_is_a_type_error(client, depth):
    body = b'{"ready": ' + b"[" * depth + b"]" * depth + b"}"
    assert_error(client.post("/v2/repository/index", data=body), 400, "Invalid value for 'ready': expected a boolean")


def test_repository_index_still_checks_the_depth_of_other_keys(client):
    body = b'{"ready": true, "other": ' + b"[" * 120 + b"]" * 120 + b"}"
    assert_error(client.post("/v2/repository/index", data=body), 400, "JSON nesting depth exceeds maximum")
    assert client.post("/v2/repository/index", data=b'{"ready": true}').get_json()[0]["name"] == "simple"


def test_byte_size_overflow_is_named_for_json_data(client):
    # 2**62 + 8 elements fit in int64, their 4-byte INT32 size does not (Triton's test_buffer_size_overflow)
    body = {"inputs": [{"name": "INPUT0", "shape": [4, 2**60 + 2], "datatype": "INT32", "data": [1]}]}
    assert_error(client.post("/v2/models/simple/infer", data=json.dumps(body)), 400,
                 "byte size overflow for input 'INPUT0'")


@pytest.mark.parametrize("shape", [[0, 2**70], [2**64]])
def test_dimensions_beyond_int64_are_a_400(client, shape):
    body = {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "INT32", "data": []}]}
    assert_error(client.post("/v2/models/simple/infer", data=json.dumps(body)), 400, "Unable to parse 'shape'")


def test_the_error_renderer_takes_any_message():
    from lmi_serve.dialects.triton.protocol import TritonError, error_response

    response = error_response(400, "bad '\ud800' input")
    assert response.status_code == 400 and response.get_json() == {"error": "bad '\\ud800' input"}
    assert TritonError(400, "x\udfff").message == "x\\udfff"


def test_get_tensors_names_a_missing_tensor():
    from lmi_serve.tensor_model import MissingTensor, get_tensors, tensor_input
    from lmi_serve.tensors import WireTensor
    from lmi_serve.dialects.triton.protocol import ERROR_TABLE as TRITON_ERROR_TABLE
    from lmi_serve.errors import InvalidRequest, lookup

    tensors = get_tensors(tensor_input([WireTensor("INPUT1", "INT32", (1,), np.array([1], dtype=np.int32))], {}))
    assert tensors["INPUT1"].tolist() == [1]
    with pytest.raises(MissingTensor) as raised:
        tensors["INPUT0"]
    assert isinstance(raised.value, InvalidRequest) and isinstance(raised.value, KeyError)  # old handlers catch KeyError
    assert lookup(TRITON_ERROR_TABLE, raised.value) == 400
    assert str(raised.value) == ("input tensor 'INPUT0' is missing from the request (tensors given: 'INPUT1'); "
                                 "tensor models are served on the /v2/models/<model>/infer and /generate routes")


@pytest.mark.parametrize("path, body", [("/predictions/simple", b"{}"), ("/invocations", b'{"INPUT0": [1]}'),
                                        ("/predictions/simple?INPUT0=1", b"")])
def test_lmi_routes_to_a_tensor_model_without_tensors_are_a_400_without_a_traceback(client, caplog, path, body):
    response = client.post(path, data=body)
    assert response.status_code == 400, response.data
    error = response.get_json()["error"]
    assert "INPUT0" in error and "/v2/models/<model>/infer" in error
    assert "handler failed" not in caplog.text and "Traceback" not in caplog.text


def test_a_model_refusing_a_request_is_a_400_and_a_model_failure_a_500():
    from lmi_serve.dialects.triton.protocol import ERROR_TABLE as TRITON_ERROR_TABLE
    from lmi_serve.dialects.triton.runners import _handler_output
    from lmi_serve.errors import GenerationFailed, InvalidRequest, lookup
    from lmi_serve.handler_api import Output

    class Refusing:
        name = "m"

        def __init__(self, output):
            self.dispatcher = self
            self.output = output

        def submit(self, request):
            return request

        def wait(self, job):
            return self.output

    with pytest.raises(InvalidRequest) as refused:
        _handler_output(Refusing(Output().error("input tensor 'X' is missing", code=400)), None)
    assert (lookup(TRITON_ERROR_TABLE, refused.value), refused.value.message) == (400, "input tensor 'X' is missing")
    with pytest.raises(GenerationFailed) as failed:
        _handler_output(Refusing(Output().error("boom")), None)  # 424: an exception in handle()
    assert (lookup(TRITON_ERROR_TABLE, failed.value), failed.value.message) == (500, "model 'm' failed: boom")


@pytest.mark.parametrize("path, body", [
    ("/v2/models/simple/generate", {**SIMPLE_BODY, "seed": 2**64}),
    ("/v2/models/simple/generate", {**SIMPLE_BODY, "parameters": {"top_k": 2**63}}),
    ("/v2/models/simple/infer", {"parameters": {"seed": -2**63 - 1}, "inputs": []}),
])
def test_integer_request_parameters_beyond_int64_are_a_400(client, path, body):
    assert_error(client.post(path, data=json.dumps(body)), 400, "has invalid type")


@pytest.mark.parametrize("sampling, message", [
    ({"seed": 2**64}, "seed"), ({"seed": "18446744073709551616"}, "seed"), ({"seed": 1e30}, "seed"),
    ({"seed": -1}, "seed"), ({"top_k": 2**63}, "top_k: Input should be less than or equal to"),
    ({"top_k": "9223372036854775808"}, "top_k: Input should be less than or equal to"), ({"top_k": 1e19}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
])
def test_sampling_integers_beyond_what_the_engine_takes_are_a_400(sampling, message):
    from lmi_serve.dialects.triton.llm import _parameters, _sampling_values
    from lmi_serve.dialects.triton.protocol import ERROR_TABLE as TRITON_ERROR_TABLE
    from lmi_serve.tensors import WireTensor
    from lmi_serve.errors import InvalidRequest, lookup

    tensor = WireTensor("sampling_parameters", "BYTES", (1,), np.array([json.dumps(sampling).encode()], dtype=object))
    with pytest.raises(InvalidRequest) as raised:
        _parameters(_sampling_values({"sampling_parameters": tensor}, {}))
    assert lookup(TRITON_ERROR_TABLE, raised.value) == 400 and message in raised.value.message


@pytest.mark.parametrize("raw, message", [
    (b'{"stop": ["\\ud800"]}', "lone UTF-16 surrogate"), (b"[" * 2000 + b"]" * 2000, "levels deep"),
    (b'{"temperature": NaN}', "not a valid JSON value"), (b"\xff\xfe", "must be UTF-8 text"),
])
def test_sampling_parameters_strings_are_decoded_by_the_shared_rules(raw, message):
    from lmi_serve.dialects.triton.llm import _sampling_values
    from lmi_serve.dialects.triton.protocol import ERROR_TABLE as TRITON_ERROR_TABLE
    from lmi_serve.tensors import WireTensor
    from lmi_serve.errors import InvalidRequest, lookup

    tensor = WireTensor("sampling_parameters", "BYTES", (1,), np.array([raw], dtype=object))
    with pytest.raises(InvalidRequest) as raised:
        _sampling_values({"sampling_parameters": tensor}, {})
    assert lookup(TRITON_ERROR_TABLE, raised.value) == 400 and message in raised.value.message


def test_a_deep_repository_index_body_that_is_no_object_reports_its_depth(client):
    assert_error(client.post("/v2/repository/index", data=b"[" * 200 + b"]" * 200), 400, "nesting depth")
    assert_error(client.post("/v2/repository/index", data=b"[[1]]"), 400, "expected a JSON object")
