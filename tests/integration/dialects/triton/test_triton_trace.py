"""The trace extension's settings through `tritonclient.http` (sync) and `requests`, on the real server:
the client's get/update calls work, a model overrides and clears settings, and bad values raise
InferenceServerException with Triton's status and message."""

from __future__ import annotations

import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.integration

CLEAR = {"trace_file": None, "trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}


@pytest.fixture
def client(default_server):
    triton = httpclient.InferenceServerClient(default_server.base.removeprefix("http://"))
    yield triton
    triton.update_trace_settings(model_name="simple", settings=CLEAR)  # leave the server as it was
    triton.update_trace_settings(settings=CLEAR)
    triton.close()


def test_get_update_override_and_clear_with_the_client(client):
    defaults = client.get_trace_settings()
    assert defaults["trace_level"] == ["OFF"] and defaults["trace_count"] == "-1"
    assert client.get_trace_settings(model_name="simple") == defaults
    model = client.update_trace_settings(model_name="simple", settings={"trace_rate": "12", "log_frequency": "34"})
    assert model == {**defaults, "trace_rate": "12", "log_frequency": "34"}
    updated = client.update_trace_settings(settings={"trace_rate": "56", "trace_level": ["TIMESTAMPS"]})
    assert updated == {**defaults, "trace_rate": "56", "trace_level": ["TIMESTAMPS"]}
    assert client.get_trace_settings(model_name="simple") == {**updated, "trace_rate": "12", "log_frequency": "34"}
    cleared = client.update_trace_settings(model_name="simple", settings={"trace_rate": None})
    assert cleared == {**updated, "log_frequency": "34"}
    assert client.update_trace_settings(settings={"trace_rate": None, "trace_level": None}) == defaults


@pytest.mark.parametrize("model, settings, message", [
    (None, {"trace_rate": 5}, "Unable to parse 'trace_rate': attempt to access JSON non-string as string"),
    (None, {"trace_rate": "-5"}, "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: -5"),
    ("simple", {"trace_count": "-2"}, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ("simple", {"trace_level": "TIMESTAMPS"}, "attempt to access JSON non-array as array"),
    (None, {"trace_sampling": "1"}, "Unknown trace setting(s) ['trace_sampling']"),
    ("nope", {"trace_rate": "1"}, "Request for unknown model : nope"),
])
def test_invalid_updates_raise_with_tritons_status_and_message(client, model, settings, message):
    before = client.get_trace_settings()
    with pytest.raises(InferenceServerException) as raised:
        client.update_trace_settings(model_name=model, settings=settings)
    assert raised.value.status() == "400" and message in raised.value.message()
    assert client.get_trace_settings() == before


def test_plain_requests_and_the_server_keeps_serving(default_server, client):
    response = requests.get(default_server.url("/v2/models/nope/trace/setting"), timeout=10)
    assert response.status_code == 400 and response.json() == {"error": "Request for unknown model : nope"}
    response = requests.post(default_server.url("/v2/trace/setting"), data="[1]", timeout=10)
    assert response.status_code == 400 and "expected a JSON object" in response.json()["error"]
    assert "trace" not in client.get_server_metadata()["extensions"]
    assert client.is_server_live() and client.is_model_ready("simple")
