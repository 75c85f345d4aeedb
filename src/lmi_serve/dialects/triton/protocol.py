"""Protocol plumbing shared by the Triton routes: errors, request bodies, JSON, request parameters.

Triton never looks at the request Content-Type (tritonclient sends none, curl sends a form type),
so bodies are read with `request.get_data()` and parsed here, never with `get_json()`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from flask import Response, current_app, request

from ... import json_body, json_scan
from ...errors import (
    ClientGone, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError, Timeout, lookup,
)
from ...json_scan import BodyScan

MAX_JSON_DEPTH = 100  # Triton's limit on JSON nesting
# Request-level parameters Triton itself consumes; every other one goes to the model.
RESERVED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers",
                       "binary_data_output")


def printable(message: object) -> str:
    """`message` as text that always encodes as UTF-8: a lone surrogate (which can come from a
    client's JSON or a model) shows as its `\\udXXX` escape instead of breaking the response."""
    return str(message).encode("utf-8", "backslashreplace").decode("utf-8")


class TritonError(Exception):
    """An error of Triton's own protocol, in Triton's words, status and headers: `{"error": message}`
    with `status`. Everything else (a bad sampling value, a model that failed, a full queue) is one of
    the core's kinds, answered through ERROR_TABLE."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        message = printable(message)
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return Response(data, status=status, mimetype="application/json", headers=headers)


def error_response(status: int, message: object, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": printable(message)}, status, headers)


# Flask's own errors under /v2 (no blueprint sees them) in Triton's words.
_HTTP_ERROR_MESSAGES = {404: "Not Found", 405: "Method Not Allowed"}


def app_error_response(status: int, error_type: str, message: str) -> Response:
    """The app-level renderer for the `/v2` prefix (unknown route, wrong method, body too large)."""
    if status == 413:  # Triton answers an oversized body with 400 and this wording
        return error_response(400, size_limit_message(request.content_length))
    return error_response(status, _HTTP_ERROR_MESSAGES.get(status, message))


# kind -> status; the body is always `{"error": message}`. A model that cannot take the request now is
# a 503 (Triton's status for an unavailable model), one that failed on it a 500; ContextOverflow is an
# InvalidRequest (400); an unlisted kind falls back to 503.
ERROR_TABLE: dict[type[ServingError], int] = {
    InvalidRequest: 400,
    NotFound: 404,
    NotReady: 503,
    Overloaded: 503,
    Timeout: 503,
    GenerationFailed: 500,
    ClientGone: 499,
    ServingError: 503,
}


def render_kind(error: ServingError) -> Response:
    return error_response(lookup(ERROR_TABLE, error), error.message)


def max_input_size() -> int:
    return current_app.config.get("MAX_CONTENT_LENGTH") or 64 * 1024 * 1024


def size_limit_message(size: int | None) -> str:
    of = f" of {size} bytes" if size is not None else ""
    return (f"request size{of} exceeds the maximum allowed input size of {max_input_size()} bytes; "
            "raise option.max_request_bytes to increase the limit")


# --- bodies ------------------------------------------------------------------------------------

def _decompress(body: bytes, wbits: int, limit: int) -> bytes:
    decompressor = zlib.decompressobj(wbits)
    data = decompressor.decompress(body, limit + 1)
    if len(data) > limit:
        raise TritonError(400, size_limit_message(None))
    return data


def read_body(*, allow_compression: bool) -> bytes:
    """The request body, decompressed by Content-Encoding (gzip, deflate) and capped in size."""
    body = request.get_data(cache=False)
    encoding = (request.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if not allow_compression:
        raise TritonError(400, "Unsupported content-encoding, only 'identity' is supported.")
    limit = max_input_size()
    try:
        if encoding == "gzip":
            return _decompress(body, 16 + zlib.MAX_WBITS, limit)
        if encoding == "deflate":
            try:
                return _decompress(body, zlib.MAX_WBITS, limit)  # zlib-wrapped, as RFC 9110 and tritonclient
            except zlib.error:
                return _decompress(body, -zlib.MAX_WBITS, limit)  # some clients send raw deflate
    except zlib.error as exc:
        raise TritonError(400, f"Unable to decompress the request body ({encoding}): {exc}") from None
    raise TritonError(501, "Unsupported compression type", {"Accept-Encoding": "gzip, deflate"})


def compress_for_client(body: bytes) -> tuple[bytes, str | None]:
    """Compress a response by the request's Accept-Encoding: the highest q among gzip, deflate and
    identity wins (gzip on ties); identity is always acceptable."""
    preference = {"gzip": 2, "deflate": 1, "identity": 0}
    candidates = []
    for part in (request.headers.get("Accept-Encoding") or "").split(","):
        token, _, params = part.strip().partition(";")
        token, params = token.strip().lower(), params.strip()
        try:
            q = float(params[2:]) if params.startswith("q=") else 1.0
        except ValueError:
            q = 0.0
        if token in preference and q > 0:
            candidates.append((q, preference[token], token))
    best = max(candidates)[2] if candidates else None
    if best == "gzip":
        compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        return compressor.compress(body) + compressor.flush(), "gzip"
    if best == "deflate":
        return zlib.compress(body), "deflate"
    return body, None


# --- JSON --------------------------------------------------------------------------------------

class JsonObject(dict):
    """A parsed JSON object that remembers the first key it saw twice (Python keeps the last)."""

    duplicate: str | None = None


def _object_hook(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                obj.duplicate = key
                break
            seen.add(key)
    return obj


def check_depth(scanned: BodyScan) -> None:
    """Triton's nesting limit, in Triton's words."""
    if scanned.depth > MAX_JSON_DEPTH:
        raise TritonError(400, f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})")


def parse_json(data: bytes, what: str = "request", scanned: BodyScan | None = None) -> Any:
    """JSON decoded by the shared `json_body` rules (no lone surrogates, NaN or Infinity), with
    duplicate keys remembered and Triton's nesting limit (in Triton's words) checked first.
    `scanned` is `json_scan.scan(data)` when the caller has it (one scan of the body in all)."""
    facts = scanned if scanned is not None else json_scan.scan(data)
    check_depth(facts)
    try:
        return json_body.loads(data, max_depth=MAX_JSON_DEPTH, object_pairs_hook=_object_hook, scanned=facts)
    except json_body.InvalidJson as exc:
        raise TritonError(400, f"failed to parse the {what} JSON buffer: {exc.reason}") from None


def check_parameter(key: str, value: Any) -> None:
    """Request parameters are scalars (string, int, bool, double); `triton_` keys are reserved."""
    if key.startswith("triton_"):
        raise TritonError(400, "parameter keys starting with 'triton_' are reserved for Triton usage and should "
                               "not be specified.")
    out_of_int64 = isinstance(value, int) and not -2**63 <= value < 2**63  # Triton's int parameters are int64
    if value is None or isinstance(value, (dict, list)) or out_of_int64:
        raise TritonError(400, f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
