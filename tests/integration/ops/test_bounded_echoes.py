"""100,000 unknown field names sent to each dialect's main route: the answer names a few of them and
counts the rest (under 4 KiB), the log grows by under 16 KiB, and the server keeps serving. Before
echo.py each answer or log line listed every name (3.3 million names: a 38.5 MB error body or log line).
One request per case on the ops package's server (conftest.py: its 4 MiB body limit admits the ~2 MB
bodies; its JSON log lines go through the same cap as text ones), no server of its own."""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = pytest.mark.integration

COUNT = 100_000
MAX_ANSWER = 4 * 1024
MAX_LOG_GROWTH = 16 * 1024
LLM = "smollm2-135m-instruct"


def names(prefix: str = "zz_unknown_") -> dict[str, int]:
    return {f"{prefix}{i:06d}": i for i in range(COUNT)}


# route -> (body, the status it answers, what its answer says): one body per dialect and place
# where a request's names are reported.
CASES = {
    "lmi-fields": ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}, **names()},
                   (400, 424), "and 99,992 more"),
    "lmi-parameters": ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 1, **names()}},
                       (400, 424), "and 99,992 more"),
    "openai": ("/v1/completions", {"model": LLM, "prompt": "Hi", "max_tokens": 1, **names()}, (200,), None),
    "tgi": ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}, **names()}, (422,),
            "and 99,992 more"),
    "triton-sampling": (f"/v2/models/{LLM}/generate",
                        {"text_input": "Hi", "max_tokens": 1, "sampling_parameters": json.dumps(names())},
                        (400,), "and 99,992 more"),
    "triton-parameters": (f"/v2/models/{LLM}/generate", {"text_input": "Hi", "max_tokens": 1, **names()},
                          (200,), None),
}


@pytest.fixture(scope="module")
def server(json_logs_small_body_server):
    return json_logs_small_body_server


def log_size(server) -> int:
    server.log.flush()
    return len(server.output().encode())


@pytest.mark.parametrize("case", list(CASES))
def test_a_hundred_thousand_unknown_names_cost_a_few_kib(server, case):
    path, body, statuses, says = CASES[case]
    before = log_size(server)
    response = requests.post(server.url(path), data=json.dumps(body), timeout=300,
                             headers={"Content-Type": "application/json"})
    assert response.status_code in statuses, response.text[:500]
    assert len(response.content) < MAX_ANSWER, response.text[:500]
    if says is not None:
        assert says in response.text and "zz_unknown_000000" in response.text, response.text
    assert requests.get(server.url("/ping"), timeout=30).status_code == 200
    grown = log_size(server) - before
    assert grown < MAX_LOG_GROWTH, server.output()[-2000:]


# route -> (its cap on object keys, the status its dialect gives a body it refuses as JSON)
KEY_CAPS = {"/invocations": (262_144, (400, 424)), "/v1/completions": (262_144, (400,)),
            "/generate": (131_072, (400, 422)), f"/v2/models/{LLM}/generate": (131_072, (400,))}


@pytest.mark.parametrize("path", list(KEY_CAPS))
def test_one_key_over_the_routes_cap_is_refused_naming_it(server, path):
    """Counted by the body scan and refused before a dict of that many entries is built."""
    cap, statuses = KEY_CAPS[path]
    body = "{" + ",".join(f'"{i:x}":0' for i in range(cap + 1)) + "}"
    response = requests.post(server.url(path), data=body, timeout=300, headers={"Content-Type": "application/json"})
    assert response.status_code in statuses, response.text[:500]
    assert f"takes at most {cap:,}" in response.text and len(response.content) < MAX_ANSWER, response.text


# route -> (its cap on values, the status its dialect gives a body it refuses as JSON); the other routes'
# caps (json_body.MAX_VALUES, 4,194,304) need bodies over this server's 4 MiB limit: tests/unit has them.
VALUE_CAPS = {"/generate": (262_144, (400, 422)), f"/v2/models/{LLM}/generate": (262_144, (400,))}


@pytest.mark.parametrize("path", list(VALUE_CAPS))
def test_one_value_over_the_routes_cap_is_refused_naming_it(server, path):
    """Counted by the body scan (commas outside strings) and refused before a list is built."""
    cap, statuses = VALUE_CAPS[path]
    body = '{"text_input": "Hi", "inputs": "Hi", "zz_pad": [' + ",".join(["0"] * (cap - 1)) + "]}"
    response = requests.post(server.url(path), data=body, timeout=300, headers={"Content-Type": "application/json"})
    assert response.status_code in statuses, response.text[:500]
    assert f"at least {cap + 1:,} values" in response.text and f"takes at most {cap:,}" in response.text, response.text
