"""A loopback OTLP/HTTP trace receiver: `POST /v1/traces` on 127.0.0.1, each body decoded as an
ExportTraceServiceRequest (opentelemetry-proto, as a collector decodes it) and kept, raw and decoded."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class OtlpReceiver:
    """Started on a free port; `url` is the full traces URL; `stop()` when done."""

    def __init__(self):
        self.bodies: list[bytes] = []  # as they arrived, decompressed
        self.exports: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                export = ExportTraceServiceRequest.FromString(body)  # a bad body fails the exporter's request
                with receiver._lock:
                    receiver.bodies.append(body)
                    receiver.exports.append(export)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """Every span received so far, with its resource's attributes."""
        with self._lock:
            exports = list(self.exports)
        return [(attributes(resource_spans.resource.attributes), span) for export in exports
                for resource_spans in export.resource_spans for scope in resource_spans.scope_spans
                for span in scope.spans]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(item) for item in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def attributes(pairs) -> dict[str, Any]:
    """A span's (or event's, or resource's) KeyValue list as a dict."""
    return {pair.key: value(pair.value) for pair in pairs}
