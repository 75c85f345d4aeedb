"""server/tracing.py without a model: the span a request's record makes (parent from `traceparent`,
attributes, events, child spans), what is not traced, the flush at a worker's exit through a loopback
OTLP/HTTP receiver, and that nothing but tracing.py imports OpenTelemetry (so a server without
tracing never loads it). The real server's spans: tests/integration/ops/test_tracing.py."""

from __future__ import annotations

import ast
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from flask import Flask, g
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lmi_serve.engine.observer import RequestTally
from lmi_serve.engine.types import FinishReason
from lmi_serve.errors import GenerationFailed
from lmi_serve.server.drain import on_worker_exit
from lmi_serve.server.tracing import RequestTracing, outcome
from otlp_receiver import OtlpReceiver, attributes

SRC = Path(__file__).resolve().parents[3] / "src" / "lmi_serve"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def values(**changes) -> dict:
    """An access line's values (access_log.line_fields)."""
    return {"request_id": "req-1", "method": "POST", "route": "/invocations", "model": "m", "status": 200,
            "prompt_tokens": 5, "generated_tokens": 3, "ttft_s": 0.5, "total_s": 1.0, **changes}


def tally_at(now: float, **changes) -> RequestTally:
    """One sequence: submitted 1 s ago, admitted 0.1 s later, first token at 0.5 s, last event at 0.9 s."""
    fields = dict(sequences=1, prompt_tokens=5, generated_tokens=3, submitted=now - 1.0, admitted=now - 0.9,
                  first_token=now - 0.5, finished=now - 0.1, finish_reasons=[FinishReason.LENGTH])
    return RequestTally(**{**fields, **changes})


def record(tracing: RequestTracing, method: str = "POST", headers: dict | None = None, error_kind: str | None = None,
           **changes):
    """Answer one request through the hooks' order: request_over() in the request, the span at its end."""
    app = Flask("tracing-test")
    with app.test_request_context("/invocations", method=method, headers=headers or {}):
        if error_kind:
            g.error_kind = error_kind
        over = tracing.request_over()
    if over is not None:
        now = time.monotonic()
        over(values(**changes.pop("values", {})), tally_at(now, **changes), now - 1.0, now)
    return over


@pytest.fixture
def memory():
    exporter = InMemorySpanExporter()
    tracing = RequestTracing("http://127.0.0.1:9/v1/traces", exporter=exporter)

    def spans():
        tracing.provider.force_flush()
        return {span.name: span for span in exporter.get_finished_spans()}

    yield tracing, spans
    tracing.shutdown()


def test_a_request_span_continues_the_callers_trace_with_its_facts(memory):
    tracing, spans = memory
    record(tracing, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
    found = spans()
    span = found["POST /invocations"]
    assert span.kind is SpanKind.SERVER
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE_ID, PARENT)
    assert span.parent.is_remote
    assert dict(span.attributes) == {
        "http.request.method": "POST", "http.route": "/invocations", "http.response.status_code": 200,
        "gen_ai.request.model": "m", "lmi_serve.request_id": "req-1", "lmi_serve.dialect": "none",
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 3, "lmi_serve.sequences": 1,
        "lmi_serve.queue_time_s": 0.1, "lmi_serve.ttft_s": 0.5, "lmi_serve.total_s": 1.0,
        "gen_ai.response.finish_reasons": ("length",), "lmi_serve.outcome": "ok"}
    assert span.status.status_code is StatusCode.UNSET
    assert (span.end_time - span.start_time) == pytest.approx(1e9, abs=1e3)
    first, finish = span.events
    assert (first.name, finish.name) == ("first_token", "finish")
    assert (first.timestamp - span.start_time, finish.timestamp - span.start_time) == (
        pytest.approx(0.5e9, abs=1e3), pytest.approx(0.9e9, abs=1e3))
    prefill, decode = found["prefill"], found["decode"]
    for child in (prefill, decode):
        assert child.parent.span_id == span.context.span_id and child.context.trace_id == span.context.trace_id
    assert (prefill.start_time - span.start_time, prefill.end_time) == (pytest.approx(0.1e9, abs=1e3), first.timestamp)
    assert (decode.start_time, decode.end_time) == (first.timestamp, finish.timestamp)


def test_without_a_traceparent_a_request_starts_its_own_trace(memory):
    tracing, spans = memory
    record(tracing)
    span = spans()["POST /invocations"]
    assert span.parent is None and span.context.trace_id != 0


def test_a_request_that_ran_no_sequence_has_no_events_or_children(memory):
    tracing, spans = memory
    record(tracing, error_kind="InvalidRequest", values={"status": 400, "prompt_tokens": None, "generated_tokens": None,
                                                         "ttft_s": None},
           sequences=0, prompt_tokens=0, generated_tokens=0, submitted=None, admitted=None, first_token=None,
           finished=None, finish_reasons=[])
    found = spans()
    assert list(found) == ["POST /invocations"]
    span = found["POST /invocations"]
    assert span.events == () and span.status.status_code is StatusCode.UNSET  # a 4xx is the client's
    assert span.attributes["lmi_serve.outcome"] == "client_error"
    assert span.attributes["error.type"] == "InvalidRequest"
    assert not {"gen_ai.usage.input_tokens", "lmi_serve.ttft_s", "lmi_serve.queue_time_s"} & set(span.attributes)


def test_a_failed_stream_is_an_error_span_named_by_its_kind(memory):
    tracing, spans = memory
    now = time.monotonic()
    app = Flask("tracing-test")
    with app.test_request_context("/invocations", method="POST"):
        over = tracing.request_over()
    over(values(), tally_at(now, finish_reasons=[FinishReason.ERROR], error_kind=GenerationFailed), now - 1, now)
    span = spans()["POST /invocations"]
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes["lmi_serve.outcome"], span.attributes["error.type"]) == ("error", "GenerationFailed")
    assert span.events[-1].attributes["gen_ai.response.finish_reasons"] == ("error",)


def test_get_requests_and_unsampled_parents_make_no_span(memory):
    tracing, spans = memory
    assert record(tracing, method="GET") is None
    record(tracing, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-00"})  # the caller did not sample it
    assert spans() == {}


@pytest.mark.parametrize(("status", "sequences", "reasons", "expected"), [
    (200, 2, [FinishReason.EOS_TOKEN, FinishReason.LENGTH], "ok"), (200, 0, [], "ok"),
    (200, 2, [FinishReason.LENGTH, FinishReason.CANCELLED], "cancelled"),
    (200, 1, [], "cancelled"),  # a stream closed before its sequence ended: the client left
    (499, 1, [FinishReason.CANCELLED], "cancelled"), (200, 1, [FinishReason.ERROR], "error"),
    (503, 0, [], "error"), (429, 0, [], "client_error"), (400, 0, [], "client_error"),
])
def test_outcome(status, sequences, reasons, expected):
    assert outcome(status, RequestTally(sequences=sequences, finish_reasons=reasons)) == expected


def test_a_workers_exit_exports_the_spans_still_queued_over_otlp_http(monkeypatch):
    """The batch processor waits 5 s between exports by default; the worker_exit hook must not lose
    what it holds. The receiver decodes the protobuf a collector would."""
    receiver = OtlpReceiver()
    try:
        tracing = RequestTracing(receiver.url)
        record(tracing, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
        assert receiver.spans() == []  # still queued
        app = SimpleNamespace(extensions={"lmi_serve.server.tracing": tracing})
        on_worker_exit(SimpleNamespace(wsgi=SimpleNamespace(app=app)))  # a BootingApp holding the app
        received = {span.name: (resource, span) for resource, span in receiver.spans()}
        assert set(received) == {"POST /invocations", "prefill", "decode"}
        resource, span = received["POST /invocations"]
        assert resource["service.name"] == "lmi-serve"
        assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT)
        assert attributes(span.attributes)["gen_ai.usage.output_tokens"] == 3
    finally:
        receiver.stop()


def test_on_worker_exit_before_the_app_is_built_does_nothing():
    on_worker_exit(SimpleNamespace(wsgi=SimpleNamespace(app=None)))
    on_worker_exit(SimpleNamespace())


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at module level) for every import of a source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
    return found


def test_only_tracing_imports_opentelemetry_and_only_lazily_is_it_imported():
    """Off, the server never imports the SDK: tracing.py is its only importer, and is itself imported
    only inside a function (app.start_tracing, run when an endpoint is set). The engine never imports it."""
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "tracing.py" and path.parent.name == "server":
            continue
        for module, top_level in imports(path):
            assert not module.startswith("opentelemetry"), f"{path.relative_to(SRC)} imports {module}"
            if module == "lmi_serve.server.tracing":
                assert not top_level, f"{path.relative_to(SRC)} imports the tracing module at module level"
