"""GET/POST /v2[/models/<m>]/trace/setting: Triton's settings object, validated and stored globally
and per model, a model falling back to the global settings until it sets (or after it clears) its own."""

from __future__ import annotations

import json

import pytest

from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService

DEFAULTS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
            "trace_file": "", "trace_mode": "triton"}
GLOBAL, MODEL = "/v2/trace/setting", "/v2/models/simple/trace/setting"


@pytest.fixture
def client():  # a fresh app per test: the settings live in the app
    config = build_server_config({"HOME": "/tmp"}, default_store=DEFAULT_STORE)
    simple = next(model for model in config.models if model.name == "simple")
    config = config.model_copy(update={"models": (simple,)})
    service = ModelService(simple, config.cache_dir)
    service.load()
    return create_app(config, ModelRegistry([service])).test_client()


def post(client, path, body):
    return client.post(path, data=body if isinstance(body, bytes) else json.dumps(body))


def test_defaults_for_the_server_and_every_model_version_route(client):
    for path in (GLOBAL, MODEL, "/v2/models/simple/versions/1/trace/setting"):
        response = client.get(path)
        assert response.status_code == 200 and response.mimetype == "application/json"
        assert response.get_json() == DEFAULTS


def test_a_model_override_shadows_the_global_setting_until_cleared(client):
    model = post(client, MODEL, {"trace_rate": "12", "log_frequency": "34"}).get_json()
    assert model == {**DEFAULTS, "trace_rate": "12", "log_frequency": "34"}
    assert client.get(GLOBAL).get_json() == DEFAULTS
    updated = post(client, GLOBAL, {"trace_rate": "56", "trace_count": "78", "trace_level": ["TENSORS", "TIMESTAMPS"],
                                    "trace_file": "global.log"}).get_json()
    assert updated == {**DEFAULTS, "trace_rate": "56", "trace_count": "78", "trace_level": ["TIMESTAMPS", "TENSORS"],
                       "trace_file": "global.log"}
    # the model keeps its own rate and log_frequency and follows the global settings for the rest
    assert client.get(MODEL).get_json() == {**updated, "trace_rate": "12", "log_frequency": "34"}
    cleared = post(client, MODEL, {"trace_rate": None, "trace_level": None}).get_json()
    assert cleared == {**updated, "log_frequency": "34"}
    # null on the global settings goes back to the server default
    assert post(client, GLOBAL, {"trace_rate": None, "trace_count": None}).get_json() == \
        {**updated, "trace_rate": "1000", "trace_count": "-1"}


def test_an_empty_update_changes_nothing_and_numbers_are_canonical(client):
    assert post(client, GLOBAL, {}).get_json() == DEFAULTS
    assert post(client, GLOBAL, {"trace_rate": "+007", "trace_count": "0"}).get_json()["trace_rate"] == "7"


@pytest.mark.parametrize("body, message", [
    ({"trace_rate": 5}, "Unable to parse 'trace_rate': attempt to access JSON non-string as string"),
    ({"trace_rate": "-1"}, "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: -1"),
    ({"trace_rate": "4294967296"}, "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ]"),
    ({"trace_rate": "12abc"}, "Unable to parse 'trace_rate', got: 12abc"),
    ({"log_frequency": "1.5"}, "Unable to parse 'log_frequency', got: 1.5"),
    ({"log_frequency": "-3"}, "Unable to parse 'log_frequency', value is out of range [ 0, 4294967295 ], got: -3"),
    ({"trace_count": "-2"}, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ({"trace_count": "2147483648"}, "Unable to parse 'trace_count', value is out of range [ -1, 2147483647 ]"),
    ({"trace_count": True}, "Unable to parse 'trace_count': attempt to access JSON non-string as string"),
    ({"trace_level": "OFF"}, "Unable to parse 'trace_level': attempt to access JSON non-array as array"),
    ({"trace_level": [1]}, "Unable to parse 'trace_level': attempt to access JSON non-string as string"),
    ({"trace_level": ["OFF", "TENSORS"]}, "Expect only one trace level 'OFF' is specified"),
    ({"trace_level": ["LOUD"]}, "Unable to parse 'trace_level': expected ['OFF'] or one or more of"),
    ({"trace_level": []}, "Unable to parse 'trace_level': expected ['OFF'] or one or more of"),
    ({"trace_file": ["a"]}, "Unable to parse 'trace_file': attempt to access JSON non-string as string"),
    ({"trace_mode": "opentelemetry"}, "Unable to set 'trace_mode' to 'opentelemetry': only 'triton' is supported"),
    ({"trace_rate": "5", "tracing": "on"}, "Unknown trace setting(s) ['tracing']"),
    ([], "Unable to parse the trace setting request: expected a JSON object"),
    (b"", "failed to parse the request JSON buffer"),
    (b'{"trace_file": "\\ud800"}', "lone UTF-16 surrogate"),
])
@pytest.mark.parametrize("path", [GLOBAL, MODEL])
def test_invalid_updates_are_a_400_and_change_nothing(client, path, body, message):
    response = post(client, path, body)
    assert response.status_code == 400 and response.mimetype == "application/json"
    assert message in response.get_json()["error"]
    assert client.get(path).get_json() == DEFAULTS


@pytest.mark.parametrize("method", ["get", "post"])
def test_an_unknown_model_answers_as_triton_does(client, method):
    response = getattr(client, method)("/v2/models/nope/trace/setting", data=b"{}")
    assert response.status_code == 400 and response.get_json() == {"error": "Request for unknown model : nope"}
    assert client.get("/v2/models/simple/versions/7/trace/setting").status_code == 404


def test_trace_is_not_advertised_because_no_trace_is_collected(client):
    assert "trace" not in client.get("/v2").get_json()["extensions"]
    assert client.put(GLOBAL).status_code == 405
