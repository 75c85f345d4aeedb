"""The TGI routes' request validation and error shapes, through Flask's test client (no model).

The registry's only model is still loading, so a request that passes validation answers TGI's
503; one that fails it answers 400/422 in TGI's `{"error", "error_type"}` shape, never a 500.
"""

from __future__ import annotations

import json

import pytest

from lmi_serve.config.sources import ModelConfig, ServerConfig
from lmi_serve.server.app import create_app
from lmi_serve.serving.service import ModelService, ModelStatus

ROUTES = ["/", "/generate", "/generate_stream"]


def loading_service() -> ModelService:
    """A real service whose loading never started: LOADING."""
    return ModelService(ModelConfig(name="model"), cache_dir="/nonexistent")


class FakeRegistry:
    """One model, still loading; `failure` makes every model lookup raise it."""

    def __init__(self, failure: Exception | None = None):
        self.failure = failure
        self.services = {"model": loading_service()}

    def for_invocations(self, name):
        if self.failure is not None:
            raise self.failure
        return self.services["model"]

    def health(self):
        return ModelStatus.READY, {"model": {"status": "Healthy"}}


def make_client(registry: FakeRegistry, max_request_size: int = 10_000):
    config = ServerConfig.model_construct(max_request_size=max_request_size, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    return create_app(config, registry).test_client()


@pytest.fixture
def client():
    return make_client(FakeRegistry())


def post(client, path: str, body: bytes | str):
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return client.post(path, data=data, content_type="application/json")


def assert_tgi_error(response, status: int) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str)
    return body


@pytest.mark.parametrize("path", ROUTES)
def test_parameters_given_as_strings_are_validated_after_coercion(client, path):
    for parameters in ({"top_k": "5"}, {"temperature": "0.5"}, {"top_k": "5", "temperature": "0.5", "seed": "3"}):
        accepted = post(client, path, json.dumps({"inputs": "Hi", "parameters": parameters}))
        assert assert_tgi_error(accepted, 503)["error"] == "Model model is loading"
    for parameters, field in (({"top_k": "0"}, "top_k"), ({"temperature": "0"}, "temperature")):
        refused = assert_tgi_error(post(client, path, json.dumps({"inputs": "Hi", "parameters": parameters})), 422)
        assert field in refused["error"] and refused["error_type"] == "validation"


# (field, its JSON text): ints past int64 (or past int32 for counts and token ids), seeds outside
# [0, 2**63 - 1], and floats that JSON can spell but that decode to infinity.
OUT_OF_RANGE = [
    ("top_k", str(2**63)), ("top_k", str(2**64)), ("top_k", str(2**31)), ("max_new_tokens", str(2**63)),
    ("truncate", str(2**63)), ("stop_token_ids", f"[{2**63}]"), ("seed", str(2**63)), ("seed", "-1"),
    ("seed", '"99999999999999999999"'), ("temperature", "1e400"), ("repetition_penalty", "1e400"),
    ("top_p", "-1e400"),
]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
def test_values_beyond_what_the_engine_holds_are_refused(client, path, field, value):
    body = post(client, path, '{"inputs": "Hi", "parameters": {"%s": %s}}' % (field, value))
    assert field in assert_tgi_error(body, 422)["error"]


@pytest.mark.parametrize("path", ROUTES)
def test_lmi_only_parameters_are_refused_not_ignored(client, path):
    for parameters, field in (({"output_formatter": "jsonlines"}, "output_formatter"), ({"num_beams": 2}, "num_beams")):
        refused = assert_tgi_error(post(client, path, json.dumps({"inputs": "Hi", "parameters": parameters})), 422)
        assert field in refused["error"]


@pytest.mark.parametrize("path", ROUTES)
def test_stream_must_be_a_boolean(client, path):
    body = assert_tgi_error(post(client, path, json.dumps({"inputs": "Hi", "stream": "false"})), 422)
    assert "stream" in body["error"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("body", [
    '{"inputs": "\\ud800"}',
    "[" * 1000 + "]" * 1000,
    '{"inputs": "Hi", "parameters": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}",
    '{"inputs": "Hi", "parameters": {"temperature": NaN}}',
    "{",
])
def test_bodies_that_are_not_acceptable_json_get_tgi_400(client, path, body):
    refused = assert_tgi_error(post(client, path, body), 400)
    assert refused["error"].startswith("The request body")


def test_post_root_renders_app_level_errors_in_tgi_shape():
    too_large = post(make_client(FakeRegistry(), max_request_size=100), "/", json.dumps({"inputs": "x" * 200}))
    assert "maximum request size" in assert_tgi_error(too_large, 413)["error"]
    broken = post(make_client(FakeRegistry(failure=RuntimeError("registry broke"))), "/",
                  json.dumps({"inputs": "Hi"}))
    assert "registry broke" in assert_tgi_error(broken, 500)["error"]


def test_other_methods_on_root_keep_the_lmi_shape(client):
    refused = client.put("/")
    assert refused.status_code == 405
    assert {"code", "type", "message", "error"} <= set(refused.get_json())


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/no/such/path", 404), ("POST", "/v3/nothing", 404), ("DELETE", "/ping", 405), ("PUT", "/", 405),
])
def test_errors_outside_every_dialect_carry_both_lmi_fields_and_error(client, method, path, status):
    response = client.open(path, method=method)
    body = response.get_json()
    assert response.status_code == status
    assert body["code"] == status and body["type"] and body["message"]
    assert body["error"] == body["message"]
