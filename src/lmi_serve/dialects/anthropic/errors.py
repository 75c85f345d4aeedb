"""Anthropic's error envelope: `{"type": "error", "error": {"type": ..., "message": ...}}`.

The statuses and types are Anthropic's own (its API's errors page): 400 `invalid_request_error`,
401 `authentication_error`, 403 `permission_error`, 404 `not_found_error`, 504 `timeout_error`,
500 `api_error`, 529 `overloaded_error`. The one table below gives each core kind its row. A full
queue is Anthropic's 529 (with `retry-after`; the official clients retry it); a model still
loading is a 503, also `overloaded_error`. A body over option.max_request_bytes is a 413 with
type `invalid_request_error` (the official client's error types have no other for it).
"""

from __future__ import annotations

import json

from flask import Response

from lmi_serve.errors import (
    ClientGone, ContextOverflow, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError,
    Timeout, lookup,
)
from lmi_serve.json_body import InvalidJson

OVERLOADED = 529  # Anthropic's status for "temporarily overloaded"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
          OVERLOADED: "overloaded_error"}

# kind -> status
ERROR_TABLE: dict[type[ServingError | InvalidJson], int] = {
    InvalidJson: 400,  # a body that is not JSON we accept
    InvalidRequest: 400,
    ContextOverflow: 400,
    NotFound: 404,
    NotReady: 503,
    Overloaded: OVERLOADED,
    Timeout: 504,
    GenerationFailed: 500,
    ClientGone: 499,  # nginx's code: nobody reads it, the access log does
    ServingError: 500,
}


def status(error: ServingError | InvalidJson) -> int:
    """The HTTP status the Anthropic routes answer `error` with."""
    return lookup(ERROR_TABLE, error)


def error_body(status: int, message: str) -> dict:
    error_type = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def kind_body(error: ServingError | InvalidJson) -> dict:
    """`error` as Anthropic's error object: the response body, or the `error` event of a stream that
    failed after it started."""
    return error_body(status(error), error.message)


def error_response(status: int, error_type: str, message: str) -> Response:
    """Renders an error for /v1/messages (also Flask's own 404/405/413 and the access gate's 401/403
    there); `error_type` is the server's name for it, which Anthropic's shape has no place for."""
    response = Response(json.dumps(error_body(status, message)), status=status, mimetype="application/json")
    if status == OVERLOADED:
        response.headers["retry-after"] = "1"
    return response


def render_kind(error: ServingError | InvalidJson) -> Response:
    return error_response(status(error), type(error).__name__, error.message)
