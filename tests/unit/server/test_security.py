"""security.py: the options block, the key check, and the gate over every route of the real app.

The gate tests walk the app's own URL map (create_app with no model): a route added later is
covered without a new test, and one that answered without a key would fail here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmi_serve.config.sources import ConfigError, ServerConfig, build_server_config
from lmi_serve.server import security
from lmi_serve.server.app import create_app
from lmi_serve.server.openapi import openapi_path
from lmi_serve.serving.registry import ModelRegistry

KEYS = ("key-one-7d1c", "key-two-90ab")
ADMIN = "admin-key-55e2"


def server(**env: str) -> ServerConfig:
    return build_server_config({"HF_MODEL_ID": "org/tiny", **env})


# --- options ---------------------------------------------------------------------------------

def test_keys_from_the_environment_are_kept_as_digests_only(caplog) -> None:
    config = server(LMI_SERVE_API_KEYS=f" {KEYS[0]} ,{KEYS[1]},,")
    assert config.security.api_key_digests == tuple(security.digest(k) for k in KEYS)
    dumped = config.model_dump_json() + config.describe()
    assert not any(key in dumped for key in KEYS)
    assert "api keys = on, 2 key(s)" in config.describe()
    with caplog.at_level(logging.INFO, logger="lmi_serve.server.security"):
        security.log_startup(config.security)
    assert "2 key(s)" in caplog.text and not any(key in caplog.text for key in KEYS)


def test_keys_off_by_default_and_said_so(caplog) -> None:
    config = server()
    assert not config.security.keys_required and not config.security.enable_management_api
    with caplog.at_level(logging.INFO, logger="lmi_serve.server.security"):
        security.log_startup(config.security)
    assert "API keys: off" in caplog.text


def test_option_keys_and_a_key_file_add_up_and_never_reach_the_handler(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# one per line\n{KEYS[1]}\n\n")
    config = server(OPTION_API_KEYS=KEYS[0], OPTION_API_KEYS_FILE=str(key_file))
    assert set(config.security.api_key_digests) == {security.digest(k) for k in KEYS}
    (model,) = config.models
    assert "api_keys" not in model.options and "api_keys" not in model.handler_properties()
    assert model.unknown_options == ()  # server-wide options are not "for custom handlers only"


def test_serving_properties_sets_server_options(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "serving.properties").write_text(
        f"option.model_id=org/tiny\noption.api_keys={KEYS[0]}\noption.enable_management_api=true\n"
        f"option.admin_api_keys={ADMIN}\noption.max_request_bytes=5000\noption.adapters_root={tmp_path}\n")
    config = build_server_config({}, model_dir=folder)
    assert config.security.api_key_digests == (security.digest(KEYS[0]),)
    assert config.security.admin_key_digests == (security.digest(ADMIN),)
    assert config.security.enable_management_api and config.security.adapters_root == str(tmp_path.resolve())
    assert config.max_request_size == 5000


@pytest.mark.parametrize(("env", "message"), [
    ({"LMI_SERVE_API_KEYS_FILE": "/nonexistent/keys"}, r"^LMI_SERVE_API_KEYS_FILE: cannot read"),
    ({"OPTION_ENABLE_MANAGEMENT_API": "maybe"}, r"^option.enable_management_api: 'maybe' is not a boolean"),
    ({"OPTION_ADMIN_API_KEYS": "x"}, r"^option.admin_api_keys: admin keys are set but the management API is off"),
    ({"OPTION_ADAPTERS_ROOT": "relative/dir"}, r"^option.adapters_root: 'relative/dir' is not an absolute path"),
    ({"OPTION_MAX_REQUEST_BYTES": "big"}, r"^option.max_request_bytes: 'big' is not an integer"),
    ({"OPTION_MAX_REQUEST_BYTES": "0"}, r"^option.max_request_bytes: '0' must be >= 1"),
])
def test_bad_values_name_their_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        server(**env)


def test_max_request_bytes_beats_sagemakers_variables() -> None:
    assert server(OPTION_MAX_REQUEST_BYTES="1234", SAGEMAKER_MAX_REQUEST_SIZE="99").max_request_size == 1234
    assert server(LMI_SERVE_MAX_REQUEST_BYTES="4321").max_request_size == 4321


def test_models_of_a_store_must_agree_on_a_server_wide_option(tmp_path: Path) -> None:
    for name, key in (("a", KEYS[0]), ("b", KEYS[1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serving.properties").write_text(f"option.model_id=org/{name}\noption.api_keys={key}\n")
    with pytest.raises(ConfigError, match=r"^option.api_keys: the models \(a, b\) set different values"):
        build_server_config({}, model_store=tmp_path)


# --- the key check ------------------------------------------------------------------------------

def test_bearer_tokens_and_constant_time_matching() -> None:
    digests = [security.digest(k) for k in KEYS]
    assert security.bearer_token("Bearer abc") == "abc" and security.bearer_token("bearer  abc ") == "abc"
    assert security.bearer_token("Basic abc") is None and security.bearer_token("Bearer ") is None
    assert security.key_matches(KEYS[1], digests) and not security.key_matches(KEYS[1][:-1], digests)
    assert not security.key_matches(None, digests) and not security.key_matches("", digests)


# --- the gate over the real app's URL map ----------------------------------------------------------

def make_app(**env: str):
    config = server(**env)
    return create_app(config, ModelRegistry([]))


def every_route(app) -> list[tuple[str, str, str]]:
    """(rule, method, a URL that matches it) for every rule and method the app serves."""
    routes = []
    for rule in app.url_map.iter_rules():
        template, parameters = openapi_path(rule.rule)
        url = template
        for p in parameters:
            url = url.replace("{" + p["name"] + "}", (p["schema"].get("enum") or ["x"])[0])
        routes += [(rule.rule, m, url) for m in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return routes


def shape(path: str, method: str, body: dict) -> str:
    """Which dialect's error body this is."""
    if body.get("type") == "error" and set(body["error"]) == {"type", "message"}:
        return "anthropic"
    if isinstance(body.get("error"), dict):
        return "openai"
    if set(body) == {"error", "error_type"}:
        return "tgi"
    if set(body) == {"error"}:
        return "triton"
    assert set(body) == {"code", "type", "message", "error"}, (method, path, body)
    return "lmi"


def expected_shape(path: str, method: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith(("/v1", "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/classify")):
        return "openai"
    if path.startswith(("/generate", "/info", "/health")) or (path, method) == ("/", "POST"):
        return "tgi"
    return "triton" if path.startswith("/v2") else "lmi"


def test_every_route_but_health_answers_401_without_a_key_in_its_dialect() -> None:
    app = make_app(LMI_SERVE_API_KEYS=",".join(KEYS), OPTION_ENABLE_MANAGEMENT_API="true")
    client = app.test_client()
    routes = every_route(app)
    assert len(routes) > 40  # the walk sees the whole app
    for rule, method, url in routes:
        answer = client.open(url, method=method)
        if (rule, method) in security.EXEMPT:
            assert answer.status_code != 401, (method, rule)
            continue
        assert answer.status_code == 401, (method, rule, answer.status_code)
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert shape(url, method, answer.get_json()) == expected_shape(url, method), (method, rule)
        wrong = client.open(url, method=method, headers={"Authorization": "Bearer not-a-key"})
        assert wrong.status_code == 401 and "not-a-key" not in wrong.get_data(as_text=True)
        right = client.open(url, method=method, headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert right.status_code not in (401, 403), (method, rule)


def test_the_refusals_say_what_to_send() -> None:
    client = make_app(LMI_SERVE_API_KEYS=KEYS[0]).test_client()
    assert "Authorization: Bearer" in client.post("/invocations").get_json()["message"]
    assert client.post("/v1/completions").get_json()["error"]["code"] == "invalid_api_key"
    assert client.post("/generate").get_json()["error_type"] == "unauthorized"
    assert client.get("/v2", headers={"Authorization": "Basic abc"}).get_json()["error"].startswith(
        "The Authorization header must be")
    assert client.get("/no/such/route").status_code == 401  # unknown paths too: no route discovery
    assert client.head("/ping").status_code != 401 and client.get("/v2/health/ready").status_code != 401


def test_anthropics_x_api_key_header_opens_routes_as_a_bearer_token_does() -> None:
    client = make_app(LMI_SERVE_API_KEYS=",".join(KEYS)).test_client()
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    for path in ("/v1/messages", "/v1/models", "/invocations"):  # any route: a key is a key
        refused = client.post(path, json=body, headers={"x-api-key": "not-a-key"})
        assert refused.status_code == 401 and "not-a-key" not in refused.get_data(as_text=True)
        # past the gate: no model is served here, or the route takes no POST
        assert client.post(path, json=body, headers={"x-api-key": KEYS[0]}).status_code not in (401, 403)
    # Anthropic's shape on its routes, and the refusal says both ways to send a key
    missing = client.post("/v1/messages", json=body).get_json()
    assert missing["type"] == "error" and missing["error"]["type"] == "authentication_error"
    assert "x-api-key" in missing["error"]["message"] and "Authorization: Bearer" in missing["error"]["message"]
    assert client.post("/v1/messages", json=body, headers={"x-api-key": "nope", "Authorization": f"Bearer {KEYS[1]}"}
                       ).status_code == 404  # either header that holds a key opens the route
    wrong = client.post("/v1/messages", json=body, headers={"x-api-key": "nope"}).get_json()
    assert wrong["error"] == {"type": "authentication_error", "message": "Invalid API key"}


def test_metrics_is_public_only_when_the_option_says_so() -> None:
    assert make_app(LMI_SERVE_API_KEYS=KEYS[0]).test_client().get("/metrics").status_code == 401
    open_metrics = make_app(LMI_SERVE_API_KEYS=KEYS[0], OPTION_PUBLIC_METRICS="true").test_client()
    assert open_metrics.get("/metrics").status_code == 200


MANAGEMENT = [("POST", "/models/m/adapters?name=a&src=a"), ("POST", "/models/m/adapters/a/update"),
              ("DELETE", "/models/m/adapters/a"), ("POST", "/models?url=/opt/ml/models/m"), ("DELETE", "/models/m")]


def test_management_routes_are_off_by_default_even_with_a_key() -> None:
    for env in ({}, {"LMI_SERVE_API_KEYS": KEYS[0]}):
        client = make_app(**env).test_client()
        for method, url in MANAGEMENT:
            answer = client.open(url, method=method, headers={"Authorization": f"Bearer {KEYS[0]}"})
            assert answer.status_code == 403, (method, url)
            assert "option.enable_management_api=true" in answer.get_json()["message"]
        # reading routes are not management routes: the model is unknown here, so 404
        assert client.get("/models/m/adapters", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 404


def test_admin_keys_alone_guard_the_management_routes_only(caplog) -> None:
    config = server(OPTION_ENABLE_MANAGEMENT_API="true", OPTION_ADMIN_API_KEYS=ADMIN)
    client = create_app(config, ModelRegistry([])).test_client()
    assert client.get("/v1/models").status_code == 200
    assert client.delete("/models/m/adapters/a").status_code == 401
    assert client.delete("/models/m/adapters/a", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404
    with caplog.at_level(logging.INFO, logger="lmi_serve.server.security"):
        security.log_startup(config.security)
    assert "off but for the management routes" in caplog.text and ADMIN not in caplog.text


def test_with_both_kinds_admin_keys_alone_open_the_management_routes_and_open_the_rest_too() -> None:
    client = make_app(LMI_SERVE_API_KEYS=KEYS[0], OPTION_ENABLE_MANAGEMENT_API="true",
                      OPTION_ADMIN_API_KEYS=ADMIN).test_client()
    for method, url in MANAGEMENT:
        assert client.open(url, method=method, headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 401
        # past the gate: the model (404) or the folder to register (400) does not exist here
        assert client.open(url, method=method, headers={"Authorization": f"Bearer {ADMIN}"}).status_code in (400, 404)
    assert client.get("/models/m/adapters", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 404
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
