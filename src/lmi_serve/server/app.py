"""create_app(config): the Flask app of one worker process.

It builds one ModelService per configured model (their loading starts at once on background
threads), registers one blueprint per dialect, installs the hooks around every request, and renders every
error as JSON in the dialect that owns the URL prefix (error_routing.py), including Flask's own
404/405/413 which no blueprint sees, and the access gate's 401/403 (security.py).
"""

from __future__ import annotations

import logging
import os
import uuid

from flask import Flask, Response, g, has_request_context, request

from lmi_serve.config.sources import ServerConfig
from lmi_serve.cpu_budget import CpuBudget, cpu_budget
from lmi_serve.dialects.anthropic import routes as anthropic_routes
from lmi_serve.dialects.lmi import routes as lmi_routes
from lmi_serve.dialects.lmi.front_end import lmi_front_end
from lmi_serve.dialects.openai import routes as openai_routes
from lmi_serve.dialects.openai.responses import routes as responses_routes
from lmi_serve.dialects.openai import scoring as scoring_routes
from lmi_serve.dialects.openai import tokenize as tokenize_routes
from lmi_serve.dialects.tgi import routes as tgi_routes
from lmi_serve.dialects.triton import routes as triton_routes
from lmi_serve.handler_api import CUSTOM_ATTRIBUTES_HEADER
from lmi_serve.server import access_log, logs
from lmi_serve.server import security
from lmi_serve.server.body_limit import ServingRequest
from lmi_serve.server.cpu_replicas import worker_layout
from lmi_serve.server.drain import WorkerDrain
from lmi_serve.server.error_routing import install_error_handlers, render_error
from lmi_serve.server.gpus import SLOT_ENV
from lmi_serve.server.metrics import ServingMetrics
from lmi_serve.server.openapi import blueprint as openapi_blueprint
from lmi_serve.serving import front_end, heap
from lmi_serve.serving.multi_model import ModelLoader
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService

log = logging.getLogger(__name__)

#: On a response a sequence of which its generation deadline ended (option.generation_deadline)
DEADLINE_HEADER = "X-LMI-Deadline-Exceeded"
DEADLINE_ATTRIBUTE = "lmi-deadline-exceeded=true"  # in SageMaker's custom attributes, `k=v;k=v`


def configure_threads(budget: CpuBudget, workers: int) -> int:
    """Torch's threads: this worker's share of the CPU budget (cpu_budget.py). More threads than the
    cores, or than the CPU quota, only add contention and throttling. Threads started later (the loading
    and engine threads) take the same count: tensor parallelism shares it out among the ranks (model/tp.py)
    and the numba kernels run on it (kernels/cpu/numba_bits.match_torch_threads)."""
    import torch

    threads = budget.per_worker(workers)
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


def start_tracing(app: Flask, config: ServerConfig):
    """This worker's RequestTracing when an OTLP endpoint is configured (its module, and the
    OpenTelemetry SDK, are imported only then); None otherwise."""
    if config.otlp_traces_endpoint is None:
        return None
    from lmi_serve.server.tracing import RequestTracing

    tracing = app.extensions["lmi_serve.server.tracing"] = RequestTracing(config.otlp_traces_endpoint)
    log.info("Worker %d: tracing to %s (OTLP/HTTP)", os.getpid(), config.otlp_traces_endpoint)
    return tracing


def mark_deadline_cut(response: Response) -> None:
    """Say on the response that the generation deadline ended one of its sequences: DEADLINE_HEADER, and
    DEADLINE_ATTRIBUTE added to X-Amzn-SageMaker-Custom-Attributes, the one response header InvokeEndpoint
    hands its caller. The engine's count (the request's tally, observer.py) is complete for a whole
    response; a stream's headers leave before its cut is known (unless it came before the first event),
    so a stream says it by its finish reason."""
    tally = g.get("access_tally")
    if tally is None or not tally.deadline_cuts:
        return
    response.headers[DEADLINE_HEADER] = "true"
    attributes = response.headers.get(CUSTOM_ATTRIBUTES_HEADER)
    response.headers[CUSTOM_ATTRIBUTES_HEADER] = (f"{attributes};{DEADLINE_ATTRIBUTE}" if attributes
                                                  else DEADLINE_ATTRIBUTE)


def install_request_hooks(app: Flask, config: ServerConfig, metrics: ServingMetrics, registry: ModelRegistry) -> None:
    """What runs around every view, in order: drain tracking, the request id, the access gate (API
    keys), refusing new work after SIGTERM; afterwards the id echoed, the count, the access line and
    the trace span (when tracing is on).
    GET /metrics is here too: it reads counter files only, so it answers while models load."""

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
    security.install(app, config.security, render_error, multi_model=config.multi_model)

    @app.before_request
    def refuse_work_while_draining() -> None:
        drain.refuse_new_work(request.method)  # after SIGTERM: a POST is a 503 in its route's dialect

    tracing = start_tracing(app, config)

    @app.after_request
    def echo_request_id(response: Response) -> Response:
        response.headers.setdefault("x-request-id", getattr(g, "request_id", ""))
        mark_deadline_cut(response)
        count_response(metrics, response)
        access_log.response_ready(response, tracing.request_over() if tracing is not None else None)
        return response

    app.teardown_request(lambda exc: access_log.request_torn_down())


def create_app(config: ServerConfig, registry: ModelRegistry | None = None) -> Flask:
    """One worker's app: every dialect's routes over one registry of models (loaded in the background
    unless a test passes its own), the request hooks, and the error handlers."""
    front_end.install(lmi_front_end)  # before any model loads: LMI answers the built-in text handler
    app = ServingFlask(__name__)
    metrics = ServingMetrics()
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_size
    app.config["TRITON_SERVER_NAME"] = config.triton_server_name
    app.config["STRICT_MODEL_NAMES"] = config.strict_model_names
    # A pinned replica (cpu_replicas.py) reads the budget over the whole layout's CPUs, not its own slice
    layout = worker_layout(os.environ)
    budget = cpu_budget(config.cpu_threads, os.environ, affinity=layout.cpus if layout else None)
    app.config["CPU_THREADS"] = budget.as_json(config.workers)  # GET /models/<m> shows it
    if layout is not None:
        app.config["CPU_THREADS"] |= layout.as_json(int(os.environ.get(SLOT_ENV, "0")))
    if registry is None:
        threads = configure_threads(budget, config.workers)
        logs.route_library_logs()
        log.info("Worker %d: torch uses %d thread(s) (CPU budget %d, from %s, over %d worker(s))", os.getpid(),
                 threads, budget.threads, budget.source, config.workers)
        registry = ModelRegistry.from_config(config, observer_for=metrics.for_model)
        heap.freeze_after_loads()  # a serving worker: what loading makes is frozen out of the collector's walks
        registry.start_loading()
    for service in registry.services.values():
        service.on_request = note_requested_model
    app.extensions["lmi_serve.serving.registry"] = registry
    # Models loaded and unloaded at run time (SageMaker multi-model endpoints, DJL's register API)
    app.extensions["lmi_serve.serving.loader"] = ModelLoader(
        registry, config, lambda model: ModelService(model, config.cache_dir, metrics.for_model(model.name),
                                                     on_request=note_requested_model), dict(os.environ))
    app.config["UNLOAD_GRACE"] = config.graceful_timeout  # in-flight requests of a model being unloaded
    app.register_blueprint(lmi_routes.blueprint)
    app.register_blueprint(tgi_routes.blueprint)
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(responses_routes.blueprint)  # /v1/responses (OpenAI's Responses API)
    app.register_blueprint(triton_routes.blueprint)
    app.register_blueprint(tokenize_routes.blueprint)
    app.register_blueprint(scoring_routes.blueprint)  # /score, /rerank, /classify (vLLM's)
    app.register_blueprint(anthropic_routes.blueprint)  # /v1/messages (Anthropic's Messages API)
    app.register_blueprint(openapi_blueprint)  # /openapi.json, /docs

    install_request_hooks(app, config, metrics, registry)
    install_error_handlers(app, config)
    return app
