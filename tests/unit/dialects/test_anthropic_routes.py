"""The Anthropic routes on the real app without a model: every error before a model is reached
(JSON, validation, routing, body size, an unknown model) in Anthropic's shape, never OpenAI's,
whose /v1 prefix these routes share."""

from __future__ import annotations

import pytest
from anthropic.types import ErrorResponse

from lmi_serve.config.sources import build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry

GOOD = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def client():
    config = build_server_config({"HF_MODEL_ID": "org/tiny", "LMI_SERVE_MAX_REQUEST_BYTES": "2000"})
    return create_app(config, ModelRegistry([])).test_client()


def anthropic_error(response, status: int, error_type: str, *words: str) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    ErrorResponse.model_validate(body)
    assert set(body) == {"type", "error"} and body["error"]["type"] == error_type
    for word in words:
        assert word in body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(("data", "words"), [
    (b"", ("empty",)), (b"{not json", ("not valid JSON",)), (b'{"model": "m", "max_tokens": NaN}', ("NaN",)),
    (b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", ("nested",)), (b"[]", ("JSON object",)),
])
def test_bodies_refused_before_any_model_is_looked_up(client, path, data, words):
    anthropic_error(client.post(path, data=data, content_type="application/json"), 400, "invalid_request_error",
                    *words)


def test_routing_and_size_errors_are_anthropics(client):
    anthropic_error(client.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(client.post("/v1/messages/batches"), 404, "not_found_error")
    anthropic_error(client.post("/v1/messages", data=b"x" * 3000, content_type="application/json"), 413,
                    "invalid_request_error", "option.max_request_bytes")
    assert "error" in client.post("/v1/chat/completions", data=b"").get_json()  # OpenAI's /v1 is still OpenAI's
    assert client.post("/v1/chat/completions", data=b"").get_json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_naming_it(client):
    anthropic_error(client.post("/v1/messages", json=GOOD, headers={"anthropic-version": "2023-06-01",
                                                                     "anthropic-beta": "x"}),
                    404, "not_found_error", "`m`")
