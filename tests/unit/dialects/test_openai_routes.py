"""The OpenAI routes' body decoding (json_body's rules, in OpenAI's envelope), on the blueprint
alone: every case here is refused before any model is looked up."""

from __future__ import annotations

import pytest
from flask import Flask

from lmi_serve.dialects.openai import routes

POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]


@pytest.fixture(scope="module")
def client():
    app = Flask(__name__)
    app.register_blueprint(routes.blueprint)
    return app.test_client()


def assert_openai_400(response, *words):
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_deeply_nested_bodies_are_400_before_decoding(client, path):
    body = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert_openai_400(client.post(path, data=body, content_type="application/json"), "nested", "levels")


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("body, words", [
    (rb'{"prompt": "\ud800", "input": "\ud800", "messages": [{"role": "user", "content": "\ud800"}]}',
     ("surrogate",)),
    (b'{"prompt": "hi", "temperature": NaN}', ("NaN",)),
    (b'{"prompt": "hi", "temperature": -Infinity}', ("Infinity",)),
    (b"", ("empty",)),
    (b"{not json", ("not valid JSON",)),
])
def test_bodies_json_body_refuses_are_400(client, path, body, words):
    assert_openai_400(client.post(path, data=body, content_type="application/json"), *words)
