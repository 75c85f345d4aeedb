"""Which dialect answers an error, and how: the URL decides (the longest matching prefix, or an exact
route a dialect owns outside its prefix), and the dialect's own table renders it. Every error a
request can meet goes through here, so a client always gets its dialect's shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from flask import Flask, Response, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from lmi_serve.config.sources import ServerConfig
from lmi_serve.json_body import InvalidJson
from lmi_serve.dialects.anthropic import errors as anthropic_errors
from lmi_serve.dialects.anthropic import routes as anthropic_routes
from lmi_serve.dialects.lmi import errors as lmi_errors
from lmi_serve.dialects.openai import errors as openai_errors
from lmi_serve.dialects.openai import routes as openai_routes
from lmi_serve.dialects.openai import scoring as scoring_routes
from lmi_serve.dialects.openai import tokenize as tokenize_routes
from lmi_serve.dialects.tgi import protocol as tgi_protocol
from lmi_serve.dialects.tgi import routes as tgi_routes
from lmi_serve.dialects.triton import protocol as triton_protocol
from lmi_serve.dialects.triton import routes as triton_routes
from lmi_serve.errors import ServingError

log = logging.getLogger(__name__)


class ErrorRenderers(NamedTuple):
    """How one dialect answers errors: `http` renders an HTTP-level error that comes with its
    status (Flask's 404/405/413, gunicorn's parse errors, an unexpected exception's 500); `kind`
    renders one of the core's error kinds, or a body that is not JSON, through the dialect's own table."""

    http: Callable[[int, str, str], Response]
    kind: Callable[[ServingError | InvalidJson], Response]


LMI_ERRORS = ErrorRenderers(lmi_errors.error_response, lmi_errors.render_kind)
TGI_ERRORS = ErrorRenderers(tgi_protocol.error_response, tgi_protocol.render_kind)
OPENAI_ERRORS = ErrorRenderers(openai_errors.error_response, openai_errors.render_kind)
TRITON_ERRORS = ErrorRenderers(triton_protocol.app_error_response, triton_protocol.render_kind)
ANTHROPIC_ERRORS = ErrorRenderers(anthropic_errors.error_response, anthropic_errors.render_kind)

# URL prefix -> the dialect answering errors there. Longest prefix wins; "" is LMI, which also
# answers paths that no dialect owns.
ERROR_RENDERERS: dict[str, ErrorRenderers] = {
    "": LMI_ERRORS,
    **{prefix: TGI_ERRORS for prefix in tgi_routes.ERROR_PREFIXES},
    **{prefix: OPENAI_ERRORS for prefix in openai_routes.ERROR_PREFIXES},
    **{prefix: OPENAI_ERRORS for prefix in tokenize_routes.ERROR_PREFIXES},
    **{prefix: OPENAI_ERRORS for prefix in scoring_routes.ERROR_PREFIXES},  # /v2/rerank beats Triton's /v2
    **{prefix: TRITON_ERRORS for prefix in triton_routes.ERROR_PREFIXES},
    **{prefix: ANTHROPIC_ERRORS for prefix in anthropic_routes.ERROR_PREFIXES},  # /v1/messages beats OpenAI's /v1
}

# Exact (method, path) pairs owned by a dialect other than their prefix's: TGI's `POST /`.
ROUTE_ERROR_RENDERERS: dict[tuple[str, str], ErrorRenderers] = {
    ("POST", path): TGI_ERRORS for path in tgi_routes.ERROR_POST_PATHS
}

_HTTP_ERROR_TYPES = {
    404: ("ResourceNotFoundException", "Requested resource is not found, please refer to API document."),
    405: ("MethodNotAllowedException", None),
    413: ("RequestEntityTooLargeException", None),
}


def error_renderers() -> ErrorRenderers:
    """The renderers of the dialect that owns the current request's URL."""
    renderers = ROUTE_ERROR_RENDERERS.get((request.method, request.path))
    if renderers is None:
        prefix = max((p for p in ERROR_RENDERERS if request.path.startswith(p)), key=len)
        renderers = ERROR_RENDERERS[prefix]
    return renderers


def render_error(status: int, error_type: str, message: str) -> Response:
    return error_renderers().http(status, error_type, message)


def install_error_handlers(app: Flask, config: ServerConfig) -> None:
    """Every failure a request can meet, answered in its route's dialect: the core's kinds, a body
    that is no JSON, Flask's HTTP errors, gunicorn's unreadable bodies, and anything unexpected (a
    500 with the exception's type and message, never a stack trace)."""

    @app.errorhandler(ServingError)
    @app.errorhandler(InvalidJson)
    def serving_error(exc: ServingError | InvalidJson) -> Response:
        return error_renderers().kind(exc)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        error_type, message = _HTTP_ERROR_TYPES.get(status, (type(exc).__name__, None))
        if status == 413:
            message = (f"Request body exceeds the maximum request size of {config.max_request_size} bytes "
                       "(option.max_request_bytes)")
        return render_error(status, error_type, message or exc.description or exc.name)

    @app.errorhandler(ParseException)
    @app.errorhandler(NoMoreData)
    def unreadable_body(exc: Exception) -> Response:
        # gunicorn parses a chunked or short body lazily, while a route reads it: the client's fault.
        return render_error(400, "BadRequestException", f"The request body could not be read: {exc}")

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("Unhandled error on %s", request.path)
        return render_error(500, "InternalServerException", f"{type(exc).__name__}: {exc}")
