"""One server for the ops modules that each need one non-default setting: test_access_log.py (JSON
logs, LMI_SERVE_LOG_FORMAT=json), test_body_scan.py (a 4 MiB body limit, LMI_SERVE_MAX_REQUEST_BYTES)
and test_tracing_server.py (OpenTelemetry traces to a loopback OTLP/HTTP receiver,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); test_bounded_echoes.py needs the limit (its bodies are ~2 MB) and
reads only how much the log grows. None depends on another's setting being absent: the access log's
requests are small, the body probes only read status codes, timings and memory, never the log, and
the spans go to the receiver in the background (the tracing test picks its own by trace id).

The store is the whole embedded default store: loading MiniLM's checkpoint makes transformers warn
("`torch_dtype` is deprecated!"), which must come out as JSON too (server/logs.py route_library_logs),
and the access log's every-line-is-JSON check reads it."""

from __future__ import annotations

import pytest

from otlp_receiver import OtlpReceiver
from server_process import serving

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # test_body_scan.py's LIMIT


@pytest.fixture(scope="package")
def otlp_receiver():
    """The loopback OTLP/HTTP receiver json_logs_small_body_server sends its spans to."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def json_logs_small_body_server(otlp_receiver):
    """The default store with JSON logs, a 4 MiB body limit and tracing: shared by test_access_log.py,
    test_body_scan.py and test_tracing_server.py, one start (~9 s) instead of three. The batch span
    processor exports every 0.1 s instead of 5 s, so the tracing test waits less."""
    env = {"LMI_SERVE_LOG_FORMAT": "json", "LMI_SERVE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with serving(env=env) as server:
        yield server
