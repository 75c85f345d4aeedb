"""OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`.

The OpenAI code raises the core's kinds (InvalidRequest for every validation error, with the field
as `param`); ERROR_TABLE below is the one place that gives them a status and an OpenAI `code`.
"""

from __future__ import annotations

import json

from flask import Response

from lmi_serve.json_body import InvalidJson
from lmi_serve.errors import (
    ClientGone, ContextOverflow, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError,
    Timeout, lookup,
)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable",
          504: "timeout"}

# kind -> (status, OpenAI's `code` when the error does not bring its own)
ERROR_TABLE: dict[type[ServingError | InvalidJson], tuple[int, str | None]] = {
    InvalidJson: (400, None),  # a body that is not JSON we accept
    InvalidRequest: (400, None),
    ContextOverflow: (400, "context_length_exceeded"),
    NotFound: (404, "model_not_found"),
    NotReady: (503, None),
    Overloaded: (429, "rate_limit_exceeded"),
    Timeout: (504, "timeout"),
    GenerationFailed: (500, None),
    ClientGone: (499, None),  # nginx's code: nobody reads it, the access log does
    ServingError: (500, None),
}


def status(error: ServingError | InvalidJson) -> int:
    """The HTTP status OpenAI's routes answer `error` with."""
    return lookup(ERROR_TABLE, error)[0]


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def kind_body(error: ServingError | InvalidJson) -> dict:
    """`error`'s OpenAI error object: the response body, or the last chunk of a stream that failed
    after it started."""
    status, code = lookup(ERROR_TABLE, error)
    return error_body(status, error.message, error.param, error.code or code)


def error_response(status: int, error_type: str, message: str, *, param: str | None = None,
                   code: str | None = None) -> Response:
    """Renders an error for /v1/... (also Flask's own 404/405/413 there); 429 says when to retry."""
    if status == 404 and error_type == "ResourceNotFoundException":
        code = code or "unknown_url"
    if status == 401:
        code = code or "invalid_api_key"  # OpenAI's own code for a missing or wrong key
    response = Response(json.dumps(error_body(status, message, param, code)), status=status,
                        mimetype="application/json")
    if status == 429:
        response.headers["retry-after"] = "1"
    return response


def render_kind(error: ServingError | InvalidJson) -> Response:
    status, code = lookup(ERROR_TABLE, error)
    return error_response(status, type(error).__name__, error.message, param=error.param, code=error.code or code)
