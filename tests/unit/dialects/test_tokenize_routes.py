"""POST /tokenize and /detokenize without a model: which dialect answers, and in which shape.

Every model here is still loading, so a body that passes validation and names a served model gets
503; a vLLM body answers in OpenAI's envelope, a TGI body (`inputs`) in TGI's `{"error", "error_type"}`.
"""

from __future__ import annotations

import pytest

from lmi_serve.config.sources import ModelConfig, ServerConfig
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService


@pytest.fixture
def client():
    services = [ModelService(ModelConfig(name=name, task="text-generation"), cache_dir="/nonexistent")
                for name in ("a", "b")]
    config = ServerConfig.model_construct(max_request_size=10_000, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    return create_app(config, ModelRegistry(services)).test_client()


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def tgi_error(response, status: int) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error", "error_type"}
    return body


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "a", "prompt": "hi"}),
                                        ("/tokenize", {"model": "b", "messages": [{"role": "user", "content": "hi"}]}),
                                        ("/detokenize", {"model": "a", "tokens": [1, 2]})])
def test_a_loading_model_is_a_503_in_openai_shape(client, path, body):
    assert openai_error(client.post(path, json=body), 503)["type"] == "service_unavailable"


def test_a_tgi_body_on_a_loading_model_is_tgi_503(client):
    assert tgi_error(client.post("/tokenize?model_name=a", json={"inputs": "hi"}), 503)["error_type"] == "healthcheck"


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "nope", "prompt": "hi"}),
                                        ("/detokenize", {"model": "nope", "tokens": [1]})])
def test_an_unknown_model_is_a_404_naming_the_served_ones(client, path, body):
    error = openai_error(client.post(path, json=body), 404)
    assert error["code"] == "model_not_found" and "`a`" in error["message"] and "`b`" in error["message"]


def test_an_unknown_tgi_model_name_is_tgi_404(client):
    assert tgi_error(client.post("/tokenize?model_name=nope", json={"inputs": "hi"}), 404)["error_type"] == "not_found"


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "a"}, "prompt"),
    ("/tokenize", {"model": "a", "prompt": 5}, "prompt"),
    ("/tokenize", {"model": "a", "messages": []}, "messages"),
    ("/tokenize", {"model": "a", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                   "continue_final_message": True}, None),
    ("/tokenize", {"model": "a", "messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/detokenize", {"model": "a", "tokens": ["x"]}, "tokens.0"),
    ("/detokenize", {"model": "a", "tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"model": "a"}, "tokens"),
])
def test_a_bad_vllm_body_is_a_400_naming_the_field(client, path, body, param):
    error = openai_error(client.post(path, json=body), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_json_is_an_openai_400(client, path):
    response = client.post(path, data=b"{not json", content_type="application/json")
    assert openai_error(response, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [{"inputs": ""}, {"inputs": "hi", "parameters": {"top_k": 0}},
                                  {"inputs": "hi", "unknown": 1}])
def test_a_bad_tgi_body_is_a_tgi_422(client, body):
    assert tgi_error(client.post("/tokenize?model_name=a", json=body), 422)["error_type"] == "validation"


def test_a_get_is_a_405_in_openai_shape(client):
    openai_error(client.get("/tokenize"), 405)
