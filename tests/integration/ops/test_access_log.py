"""The access log on a real server with JSON logs (LMI_SERVE_LOG_FORMAT=json): every line of the
log is one JSON object, and each request's access line carries the engine's token counts (equal
to the response's usage), its route, model and status, and none of what the client sent."""

from __future__ import annotations

import json

import pytest
import requests
from openai import OpenAI

from server_process import wait_for

pytestmark = pytest.mark.integration

LLM = "smollm2-135m-instruct"
SECRET = "zebra-marmalade-4471"  # in every prompt: it must never reach the log
KEY = "sk-never-log-this-key"


@pytest.fixture(scope="module")
def server(json_logs_small_body_server):
    # SmolLM2 (and `simple`) with JSON logs, shared with test_body_scan.py (conftest.py): its 4 MiB body
    # limit is far above these requests. The shared cache: the GGUF conversion's tqdm bar (which once broke
    # every line-parsing test on a fresh clone) is checked off by tests/unit/server/test_logs.py,
    # without a 25 s conversion here.
    assert json_logs_small_body_server.env["LMI_SERVE_LOG_FORMAT"] == "json"
    return json_logs_small_body_server


@pytest.fixture(scope="module")
def client(server, openai_client) -> OpenAI:
    return openai_client(server, api_key=KEY, strict=False)


def records(server) -> list[dict]:
    return [json.loads(line) for line in server.complete_lines() if line.strip()]


def access_line(server, request_id: str) -> dict:
    """The one access line of `request_id`, waiting for it: it is written when the response closes."""
    found: list[dict] = []

    def written() -> bool:
        found[:] = [r for r in records(server) if r.get("logger") == "lmi_serve.access"
                    and r.get("request_id") == request_id]
        return bool(found)

    wait_for(written, timeout=60)
    assert len(found) == 1, found
    return found[0]


def test_a_whole_response_is_logged_with_its_usage(server, client):
    raw = client.completions.with_raw_response.create(
        model=LLM, prompt=f"Repeat {SECRET}:", max_tokens=6, temperature=0,
        extra_headers={"x-request-id": "access-whole-1"})
    usage = raw.parse().usage
    line = access_line(server, "access-whole-1")
    assert (line["method"], line["route"], line["model"], line["status"]) == ("POST", "/v1/completions", LLM, 200)
    assert (line["prompt_tokens"], line["generated_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert 0 < line["ttft_s"] <= line["total_s"]


def test_a_stream_is_logged_when_it_ends(server, client):
    stream = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": f"Say {SECRET} twice."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": "access-stream-1"})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    line = access_line(server, "access-stream-1")
    assert (line["route"], line["model"], line["status"]) == ("/v1/chat/completions", LLM, 200)
    assert (line["prompt_tokens"], line["generated_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert 0 < line["ttft_s"] <= line["total_s"]


def test_a_tgi_stream_and_a_refused_request(server):
    body = {"inputs": f"Once {SECRET}", "parameters": {"max_new_tokens": 3}}
    with requests.post(server.url("/generate_stream"), json=body, headers={"x-request-id": "access-tgi-1"},
                       stream=True, timeout=120) as reply:
        frames = [json.loads(line[5:]) for line in reply.iter_lines(decode_unicode=True) if line.startswith("data:")]
    details = frames[-1]["details"]
    line = access_line(server, "access-tgi-1")
    assert (line["route"], line["status"]) == ("/generate_stream", 200)
    assert (line["prompt_tokens"], line["generated_tokens"]) == (details["input_length"], details["generated_tokens"])
    refused = requests.post(server.url("/v1/completions"), json={"model": LLM, "prompt": SECRET, "max_tokens": 0},
                            headers={"x-request-id": "access-refused-1"}, timeout=60)
    assert refused.status_code == 400
    line = access_line(server, "access-refused-1")
    assert line["status"] == 400 and line["generated_tokens"] is None and line["ttft_s"] is None


def test_every_line_is_json_and_nothing_the_client_sent_is_logged(server, client):
    client.completions.create(model=LLM, prompt=SECRET, max_tokens=2, extra_headers={"x-request-id": "access-last"})
    access_line(server, "access-last")
    lines = records(server)  # each line parsed as JSON, or this fails
    assert {"gunicorn.error", "lmi_serve.access", "lmi_serve.serving.service"} <= {r["logger"] for r in lines}
    assert all({"time", "level", "process", "logger", "message"} <= set(r) for r in lines)
    text = server.output()
    assert SECRET not in text and KEY not in text and "Bearer" not in text
