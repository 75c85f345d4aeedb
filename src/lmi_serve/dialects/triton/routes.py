"""Triton / KServe v2 HTTP routes: health, metadata, config, statistics, repository, trace settings,
infer, generate.

Every error is `{"error": "..."}` with Triton's status (400 client errors, 404 unknown model or
route, 405 wrong method, 501 unsupported, 503 not ready / overloaded / load refused, 500 model
failure). Views raise one of Triton's own error kinds (protocol.BadRequest, UnknownTarget, ...: Triton's
wording, each kind's status declared once) or json_body.InvalidJson, rendered here by
`protocol.render_error`; the core's kinds reach `protocol.render_kind` (Triton's one table) through
app.py, as do Flask's own 404/405/413 under /v2 (`protocol.app_error_response`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from flask import Blueprint, Response, current_app, g, request

from lmi_serve import __version__
from lmi_serve import json_body
from lmi_serve import json_scan
from lmi_serve.dialects.common.streaming import SSE_HEADERS, SSE_MIMETYPE
from lmi_serve.dialects.triton.generate import dumps, error_event, parse_generate_request, response_object, sse_events
from lmi_serve.dialects.triton.infer import infer_response, parse_infer_request
from lmi_serve.dialects.triton.models import (MODEL_VERSION, find_model, model_config, model_metadata, ready_model, repository_index,
                     validate_inputs)
from lmi_serve.dialects.triton.protocol import (
    ERROR_TABLE, MAX_JSON_DEPTH, BadRequest, NotImplementedHere, TritonError, Unavailable, UnknownTarget, check_depth,
    json_response, parse_json, read_body, render_error,
)
from lmi_serve.dialects.triton.runners import ModelCall, run_model, stream_model
from lmi_serve.dialects.triton.stats import StatsBook, Timer
from lmi_serve.dialects.triton.trace import TraceSettings, parse_update
from lmi_serve.errors import ServingError, lookup
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelStatus
from lmi_serve.tensors import WireTensor

blueprint = Blueprint("triton", __name__)
ERROR_PREFIXES = ("/v2",)
# Only what is implemented; Triton does not list `generate` either, and `trace` is left out because
# its settings are stored but no trace is collected (trace.py).
EXTENSIONS = ["binary_tensor_data", "parameters", "model_configuration", "model_repository", "statistics"]
LOAD_REFUSED = "explicit model load / unload is not allowed if polling is enabled"


@dataclass
class TritonState:
    server_name: str
    stats: StatsBook = field(default_factory=StatsBook)
    trace: TraceSettings = field(default_factory=TraceSettings)


@blueprint.record_once
def _init_state(setup) -> None:
    # "triton" (the default) lets Triton's own example scripts and QA checks (metadata["name"] == "triton") pass.
    setup.app.extensions["lmi_serve.triton"] = TritonState(setup.app.config.get("TRITON_SERVER_NAME", "triton"))


def _state() -> TritonState:
    return current_app.extensions["lmi_serve.triton"]


def _registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.serving.registry"]


def model_route(suffix: str, methods: list[str]):
    """Register a view under /v2/models/<model> and /v2/models/<model>/versions/<version>."""
    def register(view):
        blueprint.add_url_rule(f"/v2/models/<model>{suffix}", view_func=view, methods=methods)
        blueprint.add_url_rule(f"/v2/models/<model>/versions/<version>{suffix}", view_func=view, methods=methods)
        return view
    return register


def _version(version: str | None) -> str | None:
    if version is not None and not version.isdigit():
        raise UnknownTarget("Not Found")  # Triton's URL pattern only takes digits here
    return version


@blueprint.errorhandler(TritonError)
@blueprint.errorhandler(json_body.InvalidJson)
def _protocol_error(exc: TritonError | json_body.InvalidJson) -> Response:
    return render_error(exc)


@blueprint.get("/v2")
def server_metadata() -> Response:
    return json_response({"name": _state().server_name, "version": __version__, "extensions": EXTENSIONS})


@blueprint.get("/v2/health/live")
def live() -> Response:
    if _registry().stopping:  # Triton's answer on both health routes while it shuts down (drain.py)
        return render_error(Unavailable("Server exiting"))
    return Response(status=200)


@blueprint.get("/v2/health/ready")
def ready() -> Response:
    if _registry().stopping:
        return render_error(Unavailable("Server exiting"))
    waiting = sorted(name for name, service in _registry().services.items()
                     if service.current_status() is not ModelStatus.READY)
    if waiting:
        return render_error(BadRequest(f"Server not ready: model(s) {waiting} not ready"))
    return Response(status=200)


@model_route("", ["GET"])
def metadata(model: str, version: str | None = None) -> Response:
    return json_response(model_metadata(*ready_model(_registry(), model, _version(version))))


@model_route("/ready", ["GET"])
def model_ready(model: str, version: str | None = None) -> Response:
    service = find_model(_registry(), model, _version(version))
    if service.current_status() is not ModelStatus.READY:
        return render_error(BadRequest("Model version not ready"))
    return Response(status=200)


@model_route("/config", ["GET"])
def config(model: str, version: str | None = None) -> Response:
    return json_response(model_config(*ready_model(_registry(), model, _version(version))))


@model_route("/stats", ["GET"])
def model_stats(model: str, version: str | None = None) -> Response:
    service = find_model(_registry(), model, _version(version))
    return json_response({"model_stats": [_state().stats.model_stats(service.name, MODEL_VERSION)]})


@blueprint.get("/v2/models/stats")
def all_stats() -> Response:
    stats = [_state().stats.model_stats(name, MODEL_VERSION) for name in _registry().services]
    return json_response({"model_stats": stats})


@blueprint.post("/v2/repository/index")
@blueprint.post("/v2/repository/<repository>/index")
def repository(repository: str | None = None) -> Response:
    body = read_body(allow_compression=False)
    if not body.strip():
        return json_response(repository_index(_registry(), False))
    # One scan of the body. Within the depth limit it is decoded whole; beyond, the type of `ready`
    # is still checked before the depth is refused, as Triton does: on the outer levels alone.
    scanned = json_scan.scan(body, outline_depth=2)
    deep = scanned.depth > MAX_JSON_DEPTH
    outline = parse_json(scanned.outline, scanned=scanned.of_outline()) if deep else parse_json(body, scanned=scanned)
    if not isinstance(outline, dict):
        check_depth(scanned)  # a deep body that is no object at all reports its depth first
        raise BadRequest("Unable to parse the repository index request: expected a JSON object")
    if not isinstance(outline.get("ready", False), bool):
        raise BadRequest("Invalid value for 'ready': expected a boolean")
    check_depth(scanned)
    return json_response(repository_index(_registry(), outline.get("ready", False)))


@blueprint.route("/v2/trace/setting", methods=["GET", "POST"])
def trace_setting() -> Response:
    return _trace_setting(None)


@model_route("/trace/setting", ["GET", "POST"])
def model_trace_setting(model: str, version: str | None = None) -> Response:
    if version is not None:
        find_model(_registry(), model, _version(version))  # an unknown version is a 404, as on every route
    service = _registry().services.get(model)
    if service is None or service.current_status() is not ModelStatus.READY:
        raise BadRequest(f"Request for unknown model : {model}")  # Triton's words and status here
    return _trace_setting(model)


def _trace_setting(model: str | None) -> Response:
    settings = _state().trace
    if request.method == "GET":
        return json_response(settings.get(model))
    changes = parse_update(parse_json(read_body(allow_compression=False)))
    return json_response(settings.update(changes, model))


@blueprint.post("/v2/repository/models/<model>/<any(load, unload):action>")
@blueprint.post("/v2/repository/<repository>/models/<model>/<any(load, unload):action>")
def load_or_unload(model: str, action: str, repository: str | None = None) -> Response:
    if repository is not None:
        raise NotImplementedHere("'repository_name' specification is not supported")
    raise Unavailable(LOAD_REFUSED)  # models load once at start-up, like Triton's default control mode


@model_route("/infer", ["POST"])
def infer(model: str, version: str | None = None) -> Response:
    service, contract = ready_model(_registry(), model, _version(version))
    body = read_body(allow_compression=True)
    parsed = parse_infer_request(body, request.headers.get("Inference-Header-Content-Length"), service.name, contract)
    tensors = validate_inputs(service.name, contract, parsed.inputs)
    call = ModelCall(service, contract, tensors, parsed.parameters, parsed.request_id or g.request_id,
                     parsed.requested_outputs)
    with Timer(_state().stats, service.name):
        outputs = run_model(call)
    return infer_response(service.name, parsed, outputs)


def _generate_call(model: str, version: str | None) -> tuple[ModelCall, str]:
    service, contract = ready_model(_registry(), model, _version(version))
    parsed = parse_generate_request(read_body(allow_compression=False), service.name, contract)
    tensors = validate_inputs(service.name, contract, parsed.tensors)
    return ModelCall(service, contract, tensors, parsed.parameters, parsed.request_id or g.request_id,
                     None), parsed.request_id


@model_route("/generate", ["POST"])
def generate(model: str, version: str | None = None) -> Response:
    call, request_id = _generate_call(model, version)
    with Timer(_state().stats, call.service.name):
        outputs = run_model(call)
    return Response(dumps(response_object(call.service.name, request_id, outputs)), mimetype="application/json")


@model_route("/generate_stream", ["POST"])
def generate_stream(model: str, version: str | None = None) -> Response:
    call, request_id = _generate_call(model, version)
    if call.contract.kind == "llm" and "stream" not in call.tensors:
        call.tensors["stream"] = _stream_flag()  # our default here: stream tokens (docs/triton.md, Decisions)
    started = time.perf_counter_ns()
    responses = stream_model(call)  # validation and submission errors raise here: a JSON error
    try:
        responses.start()  # the status line waits for the model's first event
    except ServingError as exc:  # the model failed before its first token: a real status, Triton's SSE body
        _state().stats.record(call.service.name, success=False, elapsed_ns=time.perf_counter_ns() - started)
        return Response(error_event(exc.message), status=lookup(ERROR_TABLE, exc), mimetype=SSE_MIMETYPE)
    events = _recorded(sse_events(call.service.name, request_id, responses), _state().stats, call.service.name,
                       started)
    response = Response(events, mimetype=SSE_MIMETYPE, headers=SSE_HEADERS)
    response.call_on_close(responses.close)  # cancels the generation even if the body is never read
    return response


def _stream_flag() -> WireTensor:
    return WireTensor("stream", "BOOL", (1,), np.array([True]))


def _recorded(events: Iterator[str], book: StatsBook, model: str, started: int) -> Iterator[str]:
    """The SSE events, counted in the statistics when the stream ends (however it ends)."""
    failed = False
    try:
        for event in events:
            failed = failed or event.startswith('data: {"error"')
            yield event
    finally:
        events.close()
        book.record(model, success=not failed, elapsed_ns=time.perf_counter_ns() - started)
