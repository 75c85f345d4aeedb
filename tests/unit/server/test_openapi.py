"""The OpenAPI table against the app's URL map, both ways, without a server."""

from __future__ import annotations

from openapi_spec_validator import validate

from lmi_serve.config.sources import ServerConfig
from lmi_serve.server.app import create_app
from lmi_serve.server.openapi import OPERATIONS, build_document, openapi_path, served_operations
from lmi_serve.serving.registry import ModelRegistry


def app():
    config = ServerConfig.model_construct(max_request_size=1, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    return create_app(config, ModelRegistry([]))


def test_the_table_describes_exactly_the_served_routes():
    served = served_operations(app())
    assert sorted(served - set(OPERATIONS)) == []  # a new route needs its row
    assert sorted(set(OPERATIONS) - served) == []  # a row for a route that is gone


def test_flask_rules_become_path_templates():
    assert openapi_path("/v1/models/<path:name>") == (
        "/v1/models/{name}", [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}])
    path, parameters = openapi_path("/v2/repository/<repository>/models/<model>/<any(load, unload):action>")
    assert path == "/v2/repository/{repository}/models/{model}/{action}"
    assert [p["name"] for p in parameters] == ["repository", "model", "action"]
    assert parameters[2]["schema"]["enum"] == ["load", "unload"]


def test_the_document_is_valid():
    validate(build_document(app()))


def test_routes_that_pick_a_model_by_query_say_so():
    paths = build_document(app())["paths"]
    for path, method in [("/invocations", "post"), ("/generate", "post"), ("/info", "get")]:
        assert "model_name" in [p["name"] for p in paths[path][method]["parameters"] if p["in"] == "query"]
    assert "parameters" not in paths["/v1/completions"]["post"]  # OpenAI picks by the body's `model`


def test_with_api_keys_the_document_says_which_routes_need_one():
    from lmi_serve.config.sources import build_server_config

    keyed = create_app(build_server_config({"HF_MODEL_ID": "org/tiny", "LMI_SERVE_API_KEYS": "k"}), ModelRegistry([]))
    document = build_document(keyed)
    validate(document)
    assert document["security"] == [{"apiKey": []}, {"apiKeyHeader": []}]  # either header opens a route
    assert document["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    assert document["components"]["securitySchemes"]["apiKeyHeader"] == {"type": "apiKey", "in": "header",
                                                                          "name": "x-api-key"}
    assert document["paths"]["/ping"]["get"]["security"] == []  # health: no key
    assert "security" not in document["paths"]["/invocations"]["post"]  # the document-wide requirement
    assert "security" not in build_document(app())
