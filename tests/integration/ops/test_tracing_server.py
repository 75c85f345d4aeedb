"""OpenTelemetry traces from a real server (the ops package's shared one, with
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set to a loopback OTLP/HTTP receiver that decodes the protobuf):
a request with a `traceparent` gets one SERVER span in the caller's trace, under the caller's span,
with its facts as attributes, `first_token` and `finish` events and `prefill` / `decode` children,
through two dialects; neither the prompt nor the output appears anywhere in what was exported."""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from otlp_receiver import attributes
from server_process import wait_for

pytestmark = pytest.mark.integration

LLM = "smollm2-135m-instruct"
SECRET = "quokka-tangerine-9052"  # in every prompt: it must never be exported


@pytest.fixture(scope="module")
def server(json_logs_small_body_server):
    assert json_logs_small_body_server.env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].endswith("/v1/traces")
    return json_logs_small_body_server


def access_line(server, request_id: str) -> dict:
    """The request's access line (JSON logs): written when its response closes."""
    found: list[dict] = []

    def written() -> bool:
        found[:] = [record for record in map(json.loads, filter(str.strip, server.complete_lines()))
                    if record.get("logger") == "lmi_serve.access" and record.get("request_id") == request_id]
        return bool(found)

    wait_for(written, timeout=60)
    return found[0]


def caller() -> tuple[str, str, str]:
    """A fresh (trace id, parent span id, traceparent header), sampled."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent, f"00-{trace_id}-{parent}-01"


def spans_of(receiver, trace_id: str, count: int) -> dict:
    """The spans of one trace by name, once `count` of them arrived (the processor exports every 0.1 s)."""
    found = {}

    def arrived() -> bool:
        found.clear()
        found.update({span.name: span for _, span in receiver.spans() if span.trace_id.hex() == trace_id})
        return len(found) >= count

    wait_for(arrived, timeout=60)
    return found


def check_request_span(found: dict, parent: str, route: str, dialect: str, prompt_tokens: int,
                       output_tokens: int) -> dict:
    """The request span's parentage, attributes, events and children; its attributes."""
    span = found[f"POST {route}"]
    assert span.kind == span.SPAN_KIND_SERVER and span.parent_span_id.hex() == parent
    facts = attributes(span.attributes)
    assert {key: facts[key] for key in ("http.route", "http.request.method", "http.response.status_code",
                                        "gen_ai.request.model", "lmi_serve.dialect", "lmi_serve.outcome")} == {
        "http.route": route, "http.request.method": "POST", "http.response.status_code": 200,
        "gen_ai.request.model": LLM, "lmi_serve.dialect": dialect, "lmi_serve.outcome": "ok"}
    assert (facts["gen_ai.usage.input_tokens"], facts["gen_ai.usage.output_tokens"]) == (prompt_tokens, output_tokens)
    assert 0 <= facts["lmi_serve.queue_time_s"] <= facts["lmi_serve.ttft_s"] <= facts["lmi_serve.total_s"]
    assert facts["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    first, finish = span.events
    assert (first.name, finish.name) == ("first_token", "finish")
    assert span.start_time_unix_nano < first.time_unix_nano <= finish.time_unix_nano <= span.end_time_unix_nano
    prefill, decode = found["prefill"], found["decode"]
    assert prefill.parent_span_id == decode.parent_span_id == span.span_id
    assert span.start_time_unix_nano <= prefill.start_time_unix_nano < prefill.end_time_unix_nano
    assert prefill.end_time_unix_nano == first.time_unix_nano
    assert (decode.start_time_unix_nano, decode.end_time_unix_nano) == (first.time_unix_nano, finish.time_unix_nano)
    return facts


def test_an_openai_stream_and_an_lmi_request_continue_their_callers_traces(server, otlp_receiver, openai_client):
    """The two requests run at once (one batch, and two spans that must not mix)."""
    chat_trace, chat_parent, chat_header = caller()
    lmi_trace, lmi_parent, lmi_header = caller()

    def lmi_request() -> requests.Response:
        return requests.post(server.url("/invocations"), timeout=120,
                             headers={"traceparent": lmi_header, "x-request-id": "trace-lmi-1"}, json={
            "inputs": f"Tell me about {SECRET}.", "parameters": {"max_new_tokens": 6, "details": True}})

    with ThreadPoolExecutor(1) as pool:
        lmi_answer = pool.submit(lmi_request)
        stream = openai_client(server, strict=False).chat.completions.create(
            model=LLM, messages=[{"role": "user", "content": f"Say {SECRET} twice."}], max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"traceparent": chat_header, "x-request-id": "trace-chat-1"})
        chunks = list(stream)
        answer = lmi_answer.result()
    usage = chunks[-1].usage
    chat_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert requests.get(server.url("/ping"), headers={"traceparent": caller()[2]}, timeout=30).status_code == 200

    chat = check_request_span(spans_of(otlp_receiver, chat_trace, 3), chat_parent, "/v1/chat/completions", "openai",
                              usage.prompt_tokens, usage.completion_tokens)
    assert chat["lmi_serve.request_id"] == "trace-chat-1"
    # The LMI body counts no prompt tokens: the access line does, from the same record as the span
    line = access_line(server, "trace-lmi-1")
    assert line["generated_tokens"] == body["details"]["generated_tokens"]
    check_request_span(spans_of(otlp_receiver, lmi_trace, 3), lmi_parent, "/invocations", "lmi",
                       line["prompt_tokens"], line["generated_tokens"])

    exported = b"".join(otlp_receiver.bodies)
    assert SECRET.encode() not in exported
    for text in (chat_text, body["generated_text"]):
        assert len(text.strip()) >= 8 and text.strip().encode() not in exported
    assert not [span for _, span in otlp_receiver.spans() if span.name.startswith("GET")]  # health probes
