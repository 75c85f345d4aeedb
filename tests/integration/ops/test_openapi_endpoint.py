"""GET /openapi.json and /docs on the real server: a valid OpenAPI 3.1 document naming every route
the app serves, and a docs page whose scripts and styles all come from the server itself."""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urlsplit

import pytest
import requests
from openapi_spec_validator import validate

from lmi_serve.config.sources import ServerConfig
from lmi_serve.server.app import create_app
from lmi_serve.server.openapi import openapi_path, served_operations
from lmi_serve.serving.registry import ModelRegistry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def document(default_server) -> dict:
    reply = requests.get(default_server.url("/openapi.json"), timeout=60)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/json")
    return reply.json()


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on any violation of the OpenAPI 3.1 schema, dangling $refs included


def test_every_route_the_app_serves_is_in_the_document(document):
    config = ServerConfig.model_construct(max_request_size=1, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    served = served_operations(create_app(config, ModelRegistry([])))
    assert len(served) > 40
    missing = [(rule, method) for rule, method in sorted(served)
               if method.lower() not in document["paths"].get(openapi_path(rule)[0], {})]
    assert not missing


def test_request_bodies_are_the_validating_models(document):
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = document["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["GenerationParameters"]["properties"]["max_new_tokens"]["minimum"] == 1
    action = document["paths"]["/v2/repository/models/{model}/{action}"]["post"]["parameters"]
    assert {"name": "action", "in": "path", "required": True,
            "schema": {"type": "string", "enum": ["load", "unload"]}} in action


class _Assets(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.urls.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.urls.append(attrs["href"])


def test_docs_page_loads_everything_from_the_server(default_server):
    page = requests.get(default_server.url("/docs"), timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = _Assets()
    assets.feed(page.text)
    assert len(assets.urls) >= 2
    for url in assets.urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc, url  # no CDN: a path on this server
        fetched = requests.get(default_server.url(url), timeout=60)
        assert fetched.status_code == 200 and len(fetched.content) > 1000, url
    assert "/openapi.json" in page.text
