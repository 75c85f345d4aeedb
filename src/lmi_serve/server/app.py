"""create_app(config): the Flask app of one worker process.

It builds one ModelService per configured model (their loading starts at once on background
threads), registers one blueprint per dialect, and renders every error as JSON in the dialect
that owns the URL prefix, including Flask's own 404/405/413 which no blueprint sees, and the
access gate's 401/403 (security.py).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import NamedTuple

from flask import Flask, Response, g, has_request_context, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from lmi_serve.config.sources import ServerConfig
from lmi_serve.dialects.common.json_body import InvalidJson
from lmi_serve.dialects.lmi import errors as lmi_errors
from lmi_serve.dialects.lmi import routes as lmi_routes
from lmi_serve.dialects.openai import errors as openai_errors
from lmi_serve.dialects.openai import routes as openai_routes
from lmi_serve.dialects.openai import tokenize as tokenize_routes
from lmi_serve.dialects.tgi import protocol as tgi_protocol
from lmi_serve.dialects.tgi import routes as tgi_routes
from lmi_serve.dialects.triton import protocol as triton_protocol
from lmi_serve.dialects.triton import routes as triton_routes
from lmi_serve.errors import ServingError
from lmi_serve.server import access_log
from lmi_serve.server import security
from lmi_serve.server.body_limit import ServingRequest
from lmi_serve.server.drain import WorkerDrain
from lmi_serve.server.metrics import ServingMetrics
from lmi_serve.server.openapi import blueprint as openapi_blueprint
from lmi_serve.serving.registry import ModelRegistry

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

# URL prefix -> the dialect answering errors there. Longest prefix wins; "" is LMI, which also
# answers paths that no dialect owns.
ERROR_RENDERERS: dict[str, ErrorRenderers] = {
    "": LMI_ERRORS,
    **{prefix: TGI_ERRORS for prefix in tgi_routes.ERROR_PREFIXES},
    **{prefix: OPENAI_ERRORS for prefix in openai_routes.ERROR_PREFIXES},
    **{prefix: OPENAI_ERRORS for prefix in tokenize_routes.ERROR_PREFIXES},
    **{prefix: TRITON_ERRORS for prefix in triton_routes.ERROR_PREFIXES},
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


def configure_threads(workers: int) -> int:
    """One worker's share of the cores: more threads than cores only adds contention."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, workers))
    torch.set_num_threads(threads)
    return threads


class ServingFlask(Flask):
    """Flask, noting the kind of every exception a request raised (any blueprint's or the app's
    handler then renders it): the one place the error counts by kind learn it. Its requests refuse
    a chunked body over the limit rather than truncate it (body_limit.py)."""

    request_class = ServingRequest

    def handle_user_exception(self, e: Exception):
        g.error_kind = type(e).__name__
        return super().handle_user_exception(e)


def note_requested_model(name: str) -> None:
    """ModelService.on_request: label this request's counts with the model it reached."""
    if has_request_context():
        g.model_name = name


def count_response(metrics: ServingMetrics, response: Response) -> None:
    """The HTTP layer's one count per request (not /metrics itself, which scrapers call on a timer).
    `route` is the matched URL rule (bounded, unlike paths); `dialect` its blueprint."""
    if request.path == "/metrics":
        return
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    metrics.count_response(g.get("model_name", ""), request.blueprint or "none", route, response.status_code,
                           g.get("error_kind"))


def create_app(config: ServerConfig, registry: ModelRegistry | None = None) -> Flask:
    app = ServingFlask(__name__)
    metrics = ServingMetrics()
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_size
    app.config["TRITON_SERVER_NAME"] = config.triton_server_name
    app.config["STRICT_MODEL_NAMES"] = config.strict_model_names
    if registry is None:
        threads = configure_threads(config.workers)
        log.info("Worker %d: torch uses %d thread(s)", os.getpid(), threads)
        registry = ModelRegistry.from_config(config, observer_for=metrics.for_model)
        registry.start_loading()
    for service in registry.services.values():
        service.on_request = note_requested_model
    app.extensions["lmi_serve.serving.registry"] = registry
    app.register_blueprint(lmi_routes.blueprint)
    app.register_blueprint(tgi_routes.blueprint)
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(triton_routes.blueprint)
    app.register_blueprint(tokenize_routes.blueprint)
    app.register_blueprint(openapi_blueprint)  # /openapi.json, /docs

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        # Reads counter files only: answers while models load, and no model is touched.
        body, content_type = metrics.render()
        return Response(body, status=200, content_type=content_type)

    drain = app.extensions["lmi_serve.server.drain"] = WorkerDrain(registry, config.graceful_timeout)
    app.wsgi_app = drain.track(app.wsgi_app)  # requests in flight, which a SIGTERM lets finish

    @app.before_request
    def assign_request_id() -> None:
        g.request_id = request.headers.get(config.request_id_header) or str(uuid.uuid4())
        access_log.request_started()

    # API keys and the management switch (security.py): before any view, any model work, or the body
    security.install(app, config.security, render_error)

    @app.before_request
    def refuse_work_while_draining() -> None:
        drain.refuse_new_work(request.method)  # after SIGTERM: a POST is a 503 in its route's dialect

    @app.after_request
    def echo_request_id(response: Response) -> Response:
        response.headers.setdefault("x-request-id", getattr(g, "request_id", ""))
        count_response(metrics, response)
        access_log.response_ready(response)
        return response

    app.teardown_request(lambda exc: access_log.request_torn_down())

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

    return app
