"""Protocol plumbing shared by the Triton routes: errors, request bodies, JSON, request parameters.

Triton never looks at the request Content-Type (tritonclient sends none, curl sends a form type),
so bodies are read with `request.get_data()` and parsed here, never with `get_json()`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, ClassVar

from flask import Response, current_app, request

from lmi_serve import json_body
from lmi_serve import json_scan
from lmi_serve.json_scan import BodyScan
from lmi_serve.errors import (
    ClientGone, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError, Timeout, lookup,
)

MAX_JSON_DEPTH = 100  # Triton's limit on JSON nesting
# Request-level parameters Triton itself consumes; every other one goes to the model.
RESERVED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers",
                       "binary_data_output")


def printable(message: object) -> str:
    """`message` as text that always encodes as UTF-8: a lone surrogate (which can come from a
    client's JSON or a model) shows as its `\\udXXX` escape instead of breaking the response."""
    return str(message).encode("utf-8", "backslashreplace").decode("utf-8")


class TritonError(Exception):
    """An error of Triton's own protocol, in Triton's words: `{"error": message}` with `status` and
    any `headers`. Raise one of its kinds below, which each declare their status once; everything
    else (a bad sampling value, a model that failed, a full queue) is one of the core's kinds, and a
    body that is not JSON is json_body.InvalidJson: `render_error` answers all three."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        message = printable(message)
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def reworded(self, message: str) -> TritonError:
        """The same error (kind, status, headers) with another message."""
        copy = type(self).__new__(type(self))
        TritonError.__init__(copy, self.status, message, self.headers)
        return copy


class _TritonKind(TritonError):
    STATUS: ClassVar[int]

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(self.STATUS, message, headers)


class BadRequest(_TritonKind):
    """The request breaks Triton's protocol (malformed, inconsistent or unsupported by this server)."""
    STATUS = 400


class UnknownTarget(_TritonKind):
    """The URL names no model or version served here (or a version Triton's route would not match)."""
    STATUS = 404


class NotImplementedHere(_TritonKind):
    """A protocol feature Triton defines that this server does not offer."""
    STATUS = 501


class Unavailable(_TritonKind):
    """The model exists but cannot take requests (not ready; or a load / unload, which is refused)."""
    STATUS = 503


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
        return render_error(BadRequest(size_limit_message(request.content_length)))
    return error_response(status, _HTTP_ERROR_MESSAGES.get(status, message))


# kind -> status; the body is always `{"error": message}`. Triton's own protocol errors (TritonError's
# kinds above) carry their status instead. A model that cannot take the request now is
# a 503 (Triton's status for an unavailable model), one that failed on it a 500; ContextOverflow is an
# InvalidRequest (400); an unlisted kind falls back to 503.
ERROR_TABLE: dict[type[ServingError | json_body.InvalidJson], int] = {
    json_body.InvalidJson: 400,
    InvalidRequest: 400,
    NotFound: 404,
    NotReady: 503,
    Overloaded: 503,
    Timeout: 503,
    GenerationFailed: 500,
    ClientGone: 499,
    ServingError: 503,
}


def render_kind(error: ServingError | json_body.InvalidJson) -> Response:
    """A core kind, or a body that is not JSON (in Triton's words), through ERROR_TABLE."""
    if isinstance(error, json_body.InvalidJson):
        return error_response(lookup(ERROR_TABLE, error), f"failed to parse the request JSON buffer: {error.reason}")
    return error_response(lookup(ERROR_TABLE, error), error.message)


def render_error(error: TritonError | ServingError | json_body.InvalidJson) -> Response:
    """Triton's one answer to a failed request: `{"error": message}` with the status of its kind."""
    if isinstance(error, TritonError):
        return error_response(error.status, error.message, error.headers)
    return render_kind(error)


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
        raise BadRequest(size_limit_message(None))
    return data


def read_body(*, allow_compression: bool) -> bytes:
    """The request body, decompressed by Content-Encoding (gzip, deflate) and capped in size."""
    body = request.get_data(cache=False)
    encoding = (request.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if not allow_compression:
        raise BadRequest("Unsupported content-encoding, only 'identity' is supported.")
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
        raise BadRequest(f"Unable to decompress the request body ({encoding}): {exc}") from None
    raise NotImplementedHere("Unsupported compression type", {"Accept-Encoding": "gzip, deflate"})


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
        raise BadRequest(f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})")


def parse_json(data: bytes, scanned: BodyScan | None = None, max_values: int = json_body.FIXED_SCHEMA_VALUES) -> Any:
    """JSON decoded by the shared `json_body` rules (no lone surrogates, NaN or Infinity), with
    duplicate keys remembered and Triton's nesting limit (in Triton's words) checked first; other
    refusals raise json_body.InvalidJson, which `render_error` words as Triton does.
    `scanned` is `json_scan.scan(data)` when the caller has it (one scan of the body in all);
    `max_values`: the route's cap on values (an inference request's follows its model's inputs)."""
    keys = json_body.FIXED_SCHEMA_KEYS  # Triton's bodies: tensors, a few keys
    facts = scanned if scanned is not None else json_scan.scan(data, max_keys=keys, max_commas=max_values)
    check_depth(facts)
    return json_body.loads(data, max_depth=MAX_JSON_DEPTH, object_pairs_hook=_object_hook, scanned=facts,
                           max_keys=keys, max_values=max_values)


def check_parameter(key: str, value: Any) -> None:
    """Request parameters are scalars (string, int, bool, double); `triton_` keys are reserved."""
    if key.startswith("triton_"):
        raise BadRequest("parameter keys starting with 'triton_' are reserved for Triton usage and should "
                         "not be specified.")
    out_of_int64 = isinstance(value, int) and not -2**63 <= value < 2**63  # Triton's int parameters are int64
    if value is None or isinstance(value, (dict, list)) or out_of_int64:
        raise BadRequest(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
