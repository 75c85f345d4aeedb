"""OpenTelemetry traces: one span per POST request, sent over OTLP/HTTP (protobuf) in the background.

On only when an endpoint is configured (`option.otlp_traces_endpoint`, else
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): app.py imports this module then, and only then, so a server
without tracing never imports the SDK (benchmarks/bench_tracing.py measures both). Each gunicorn
worker builds its own `RequestTracing` when it builds its app, after the fork, so the batch
processor's export thread lives in the process that records; gunicorn's `worker_exit` hook
(drain.on_worker_exit) flushes what is still queued once the worker has drained.

A span is made when a request's response is over, from the access log's record of it
(access_log.py: the line's values and the engine's RequestTally), so nothing is counted twice:
  - parent: the request's `traceparent` / `tracestate` (W3C trace context), else a new trace;
  - name `POST <route>`, kind SERVER, from the request's arrival to its end (a stream's last byte);
  - attributes: route, method, status, model, dialect, request id, token counts, queue time, time
    to first token, finish reasons and an outcome; never a prompt, an output or a header's value;
  - events `first_token` and `finish`, and child spans `prefill` (admission to the first token) and
    `decode` (first token to the last event), where the request ran sequences of the rolling batch.
GET requests (health probes, /metrics, listings) are not traced: a probe every second would flood
the store with spans of no interest.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flask import g, request
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from lmi_serve.engine.observer import RequestTally
from lmi_serve.engine.types import FinishReason
from lmi_serve.server.access_log import RequestOver

SERVICE_NAME = "lmi-serve"  # the resource's service.name unless OTEL_SERVICE_NAME says otherwise
# The engine's reasons in the words of /metrics (vLLM's), plus the two ends that are not a success.
REASON_WORDS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop",
                FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "error"}


class RequestTracing:
    """One worker's tracer provider, batch processor and exporter (`exporter` replaces the OTLP/HTTP
    one in tests). `request_over()` is the access log's `then` for the request being answered."""

    def __init__(self, endpoint: str, exporter: SpanExporter | None = None):
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
        # Not the global provider: a test process may build several apps; shutdown is drain's (worker_exit).
        self.provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("lmi_serve")

    def request_over(self) -> RequestOver | None:
        """after_request: what only the request knows now (its trace parent, dialect and error kind),
        kept for the span made once the response is over; None for a request that is not traced."""
        if request.method != "POST":
            return None
        parent = propagate.extract(request.headers)  # an empty context when no traceparent came
        dialect, error_kind = request.blueprint or "none", g.get("error_kind")
        return lambda values, tally, started, now: self.record(parent, dialect, error_kind, values, tally,
                                                               started, now)

    def record(self, parent: Context, dialect: str, error_kind: str | None, values: dict[str, Any],
               tally: RequestTally, started: float, now: float) -> None:
        """The request's span and its children, from the access line's values and the tally."""
        epoch = EpochClock()
        name = f"{values['method']} {values['route'] or 'unmatched'}"
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=epoch(started))
        if span.is_recording():  # a parent that was not sampled: nothing is built
            span.set_attributes(span_attributes(values, tally, dialect, error_kind))
            if outcome(values["status"], tally) == "error":
                span.set_status(Status(StatusCode.ERROR))
            self._timeline(span, tally, epoch)
        span.end(end_time=epoch(now))

    def _timeline(self, span: Span, tally: RequestTally, epoch: EpochClock) -> None:
        """The `first_token` and `finish` events, and the `prefill` and `decode` child spans."""
        inside = set_span_in_context(span)
        if tally.first_token is not None:
            span.add_event("first_token", timestamp=epoch(tally.first_token))
            if tally.admitted is not None:
                self.tracer.start_span("prefill", context=inside, start_time=epoch(tally.admitted), attributes={
                    "gen_ai.usage.input_tokens": tally.prompt_tokens}).end(end_time=epoch(tally.first_token))
        if tally.finished is not None:
            span.add_event("finish", timestamp=epoch(tally.finished), attributes={
                "gen_ai.response.finish_reasons": finish_reasons(tally)})
            if tally.first_token is not None:
                self.tracer.start_span("decode", context=inside, start_time=epoch(tally.first_token), attributes={
                    "gen_ai.usage.output_tokens": tally.generated_tokens}).end(end_time=epoch(tally.finished))

    def shutdown(self) -> None:
        """Export what is still queued (bounded by the exporter's timeout), then stop the export thread."""
        self.provider.shutdown()


class EpochClock:
    """time.monotonic() seconds -> nanoseconds since the epoch, as OpenTelemetry takes its times."""

    def __init__(self):
        self.offset = time.time_ns() - time.monotonic_ns()

    def __call__(self, monotonic: float) -> int:
        return self.offset + int(monotonic * 1e9)


def finish_reasons(tally: RequestTally) -> list[str]:
    return [REASON_WORDS[reason] for reason in tally.finish_reasons]


def outcome(status: int, tally: RequestTally) -> str:
    """`error` (a 5xx, or a generation that failed, a stream's after its 200 included), `cancelled`
    (the client left: a 499, a sequence cancelled, or a stream that closed before its sequences
    ended, whose cancellation the engine takes at its next step), `client_error` (any other 4xx:
    refused input, an unknown model, a full queue on TGI's routes), else `ok`."""
    reasons = tally.finish_reasons
    if status >= 500 or FinishReason.ERROR in reasons:
        return "error"
    if status == 499 or FinishReason.CANCELLED in reasons or len(reasons) < tally.sequences:
        return "cancelled"
    return "client_error" if status >= 400 else "ok"


def span_attributes(values: dict[str, Any], tally: RequestTally, dialect: str,
                    error_kind: str | None) -> dict[str, Any]:
    """The request span's attributes: OpenTelemetry's semantic-convention names where they have one
    (http.*, gen_ai.*, error.type), `lmi_serve.*` for the rest. Values the request lacks are left out."""
    status = values["status"]
    failure = tally.error_kind.__name__ if tally.error_kind is not None else None
    queue = tally.queue_seconds
    found = {
        "http.request.method": values["method"], "http.route": values["route"],
        "http.response.status_code": status, "gen_ai.request.model": values["model"],
        "lmi_serve.request_id": values["request_id"] or None, "lmi_serve.dialect": dialect,
        "gen_ai.usage.input_tokens": values["prompt_tokens"], "gen_ai.usage.output_tokens": values["generated_tokens"],
        "lmi_serve.sequences": tally.sequences or None,
        "lmi_serve.queue_time_s": None if queue is None else round(queue, 6),
        "lmi_serve.ttft_s": values["ttft_s"], "lmi_serve.total_s": values["total_s"],
        "gen_ai.response.finish_reasons": finish_reasons(tally) or None,
        "lmi_serve.outcome": outcome(status, tally),
        "error.type": error_kind or failure or ("ErrorResponse" if status >= 400 else None),
    }
    return {key: value for key, value in found.items() if value is not None}
