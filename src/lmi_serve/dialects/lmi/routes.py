"""LMI / SageMaker routes: /ping, /invocations, /predictions/<model>, /models (SageMaker multi-model
endpoints and DJL's register API: models_api.py), /models/<m>/adapters.

Routes turn HTTP into an `Input`, hand it to the model's job queue, and turn the handler's
`Output` back into HTTP. They never parse the body: that is the handler's job (as in DJL).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from flask import Blueprint, Response, current_app, g, request

from lmi_serve.dialects.common.management import management_route
from lmi_serve.dialects.lmi import adapters as adapter_api
from lmi_serve.dialects.lmi import models_api
from lmi_serve.dialects.lmi.errors import error_response
from lmi_serve.engine.adapters import AdapterExists, SourceRefused
from lmi_serve.errors import InvalidRequest
from lmi_serve.handler_api import Input, Output
from lmi_serve.serving.memory_report import ModelMemory, model_memory
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService, ModelStatus

if TYPE_CHECKING:  # the engine imports torch; these routes need only the name
    from lmi_serve.engine.engine import EngineStats
    from lmi_serve.engine.kv.prefix_cache import PrefixStats

blueprint = Blueprint("lmi", __name__)

# /ping: 200 all healthy, 500 any model failed, 503 any still loading (DJL's answers) or shutting down.
_PING_STATUS = {ModelStatus.READY: 200, ModelStatus.FAILED: 500, ModelStatus.LOADING: 503, ModelStatus.STOPPING: 503}

JSON = "application/json"
# Hop-by-hop and framing headers are Werkzeug's to set, never a handler's.
_RESERVED_HEADERS = {"content-length", "transfer-encoding", "connection"}


def _registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.serving.registry"]


def _guess_content_type(body: bytes) -> str:
    return JSON if body[:1] in (b"{", b"[") else "text/plain; charset=utf-8"


def _to_response(output: Output, stream) -> Response:
    headers = {k: v for k, v in output.properties.items()
               if k.lower() not in _RESERVED_HEADERS and not k.startswith("batch_")}
    status = output.code if output.code == 200 else f"{output.code} {output.message}"
    if output.is_stream():
        mimetype = output.content_type() or "application/jsonlines"
        headers.pop("Content-Type", None)
        return Response(stream, status=status, headers=headers, mimetype=mimetype)
    body = output.body()
    if output.content_type() is None:
        headers["Content-Type"] = _guess_content_type(body)
    return Response(body, status=status, headers=headers)


def _invoke(service: ModelService) -> Response:
    request_input = Input.from_http(request.get_data(), request.headers, list(request.args.items(multi=True)),
                                    g.request_id)
    job = service.submit(request_input)
    output = service.dispatcher.wait(job)
    return _to_response(output, job.stream())


@blueprint.get("/ping")
def ping() -> Response:
    status, body = _registry().health()
    return Response(json.dumps(body), status=_PING_STATUS[status], mimetype=JSON)


@blueprint.get("/execution-parameters")
def execution_parameters() -> Response:
    """SageMaker Batch Transform asks this when a job leaves MaxConcurrentTransforms (or MaxPayloadInMB,
    BatchStrategy) unset: see `batch_transform_parameters`."""
    limit = current_app.config.get("MAX_CONTENT_LENGTH") or 0
    return Response(json.dumps(batch_transform_parameters(_registry(), limit)), mimetype=JSON)


# SageMaker refuses a transform job whose MaxPayloadInMB is over 100 (MB)
MAX_TRANSFORM_PAYLOAD_MB = 100


def _rows(service: ModelService) -> int:
    """The requests `service` takes at once: its rolling batch's rows, else its dynamic batch size.
    Before loading has resolved rolling_batch=auto, the configuration's answer (auto -> rolling)."""
    config = service.config
    rolling = service.rolling_batch if service.dispatcher is not None else config.rolling_batch != "disable"
    return config.max_rolling_batch_size if rolling else config.batch_size


def batch_transform_parameters(registry: ModelRegistry, max_request_bytes: int) -> dict:
    """MaxConcurrentTransforms: the rows of the model /invocations serves without a name (a transform
    job names none), so every concurrent request gets a row; with several models and no default, the
    smallest model's rows (any of them may be named). MaxPayloadInMB: the body limit in whole MiB
    (option.max_request_bytes, SAGEMAKER_MAX_PAYLOAD_IN_MB...), at least 1 and at most SageMaker's 100,
    so a mini-batch SageMaker builds is never refused with 413. MULTI_RECORD: /invocations splits
    JSON Lines mini-batches (multi_record.py)."""
    try:
        rows = _rows(registry.for_invocations(None))
    except InvalidRequest:
        rows = min((_rows(service) for service in registry.services.values()), default=1)
    payload_mb = min(MAX_TRANSFORM_PAYLOAD_MB, max(1, max_request_bytes // (1024 * 1024)))
    return {"MaxConcurrentTransforms": rows, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": payload_mb}


@blueprint.post("/invocations")
def invocations() -> Response:
    name = request.args.get("model_name") or request.headers.get("model_name") or request.headers.get("X-Model-Name")
    return _invoke(_registry().for_invocations(name))


@blueprint.post("/predictions/<model_name>")
@blueprint.post("/predictions/<model_name>/<version>")
def predictions(model_name: str, version: str | None = None) -> Response:
    return _invoke(_registry().get(model_name))


@blueprint.get("/models")
def list_models() -> Response:
    return Response(json.dumps(models_api.page(list(_registry().services.values()), request.args)), mimetype=JSON)


@blueprint.get("/models/<model_name>")
def describe_model(model_name: str) -> Response:
    service = _registry().get(model_name)
    if models_api.multi_model():  # SageMaker's shape, then our details
        return Response(json.dumps({**models_api.entry(service), **_describe(service)}), mimetype=JSON)
    return Response(json.dumps([{"workflowName": service.name, "models": [_describe(service)]}]), mimetype=JSON)


@blueprint.post("/models")
@management_route  # DJL's register API; SageMaker's multi-model load is open (security.py)
def load_model() -> Response:
    name, url = models_api.load_request(request.get_data(), request.args)
    models_api.loader().load(name, url)
    return Response(models_api.loaded(name), mimetype=JSON)


@blueprint.delete("/models/<model_name>")
@management_route  # DJL's unregister; SageMaker's multi-model unload is open (security.py)
def unload_model(model_name: str) -> Response:
    models_api.loader().unload(model_name, grace=current_app.config["UNLOAD_GRACE"])
    return Response(json.dumps({"status": f"Model \"{model_name}\" unregistered"}), mimetype=JSON)


@blueprint.post("/models/<model_name>/invoke")
def invoke_model(model_name: str) -> Response:
    """SageMaker multi-model endpoints' invocation: /invocations for the model the path names."""
    g.target_model = models_api.target_model()
    return _invoke(_registry().get(model_name))


def _describe(service: ModelService) -> dict:
    """LMI's GET /models/<m> entry, plus our batching and engine counters."""
    stats = service.dispatcher.stats if service.dispatcher else None
    config = service.config
    return {
        "modelName": service.name,
        "modelUrl": models_api.loader().url_of(service),
        "task": service.task,
        # config.json's architectures the task was decided from; None until loading has begun
        "architectures": list(service.task_decision.architectures) if service.task_decision else None,
        "batchSize": config.batch_size,
        "maxBatchDelayMillis": config.max_batch_delay,
        "queueSize": config.job_queue_size,
        "rollingBatch": service.rolling_batch,
        "requestInQueue": service.dispatcher.queued if service.dispatcher else 0,
        "status": service.current_status().value,
        **({"error": service.error} if service.error else {}),
        "loadedAtStartup": service.name in models_api.loader().loaded_at_startup,
        "batchStats": {"batches": stats.batches, "requests": stats.requests,
                       "largestBatch": stats.largest_batch, "lastBatchSize": stats.last_batch_size}
        if stats else None,
        # the worker's CPU threads: how many, and which limit decided them (cpu_budget.py)
        **({"cpuThreads": current_app.config["CPU_THREADS"]} if "CPU_THREADS" in current_app.config else {}),
        # the worker's resident bytes and this model's parts of them (serving/memory_report.py)
        "memory": _memory(model_memory(service)),
        # what runs the forward on this host (kernels/plan.py): in the engine section, or alone for an encoder
        **({"engine": {**_engine_stats(service.engine.stats()), **_kernels(service)}} if service.engine
           else _kernels(service)),
        # LoRA adapters with their requests (served since registration, and active now)
        **({"adapters": [a.describe() for a in service.engine.adapters.list()]}
           if getattr(service.engine, "adapters", None) is not None else {}),
    }


def _memory(memory: ModelMemory) -> dict:
    parts = {"weightsBytes": memory.weights, "rowKernelCopiesBytes": memory.row_copies,
             "kvCacheBytes": memory.kv_cache, "prefixCacheBytes": memory.prefix_cache,
             "prefixCacheBudgetBytes": memory.prefix_cache_budget}
    return {"workerResidentBytes": memory.resident, **{k: v for k, v in parts.items() if v is not None}}


def _kernels(service: ModelService) -> dict:
    plan = getattr(service, "kernels", None)
    return {"kernels": plan.describe()} if plan is not None else {}


def _engine_stats(stats: EngineStats) -> dict:
    return {"running": stats.running, "waiting": stats.waiting, "steps": stats.steps, "prefills": stats.prefills,
            "admitted": stats.admitted, "largestBatch": stats.largest_batch, "failedSteps": stats.failed_steps,
            "maxBatchSize": stats.max_batch_size, "mixedSteps": stats.mixed_steps,
            # cumulative wall seconds and entries per phase of the engine's step (engine/phases.py)
            "phaseSeconds": {name: round(seconds, 6) for name, seconds in stats.phases.seconds.items()},
            "phaseCounts": dict(stats.phases.counts),
            **({"prefixCache": _prefix_stats(stats.prefix_cache)} if stats.prefix_cache is not None else {}),
            **({"speculation": {"steps": stats.speculation.steps, "draftTokens": stats.speculation.draft_tokens,
                                "acceptedTokens": stats.speculation.accepted_tokens}}
               if stats.speculation is not None else {})}


def _prefix_stats(stats: PrefixStats) -> dict:
    return {"lookups": stats.lookups, "hits": stats.hits, "promptTokens": stats.prompt_tokens,
            "hitTokens": stats.hit_tokens, "storedBlocks": stats.stored_blocks,
            "evictedBlocks": stats.evicted_blocks, "blocks": stats.blocks, "bytes": stats.bytes}


# -- DJL's adapters management API (dialects/lmi/adapters.py) ---------------------------------------

def _json(body, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype=JSON)


def _query() -> dict[str, str]:
    return dict(request.args.items())


def _adapters_root(service: ModelService):
    return adapter_api.source_root(service, current_app.extensions["lmi_serve.server.security"].adapters_root)


@blueprint.post("/models/<model_name>/adapters")
@management_route
def register_adapter(model_name: str) -> Response:
    service = _registry().get(model_name)
    adapters = adapter_api.adapters_of(service)
    try:
        status, body = adapter_api.register(adapters, _query(), _adapters_root(service))
    except AdapterExists as exc:
        return error_response(409, "ConflictException", exc.message)
    except SourceRefused as exc:
        return error_response(403, "ForbiddenException", str(exc))
    return _json(body, status)


@blueprint.get("/models/<model_name>/adapters")
def list_adapters(model_name: str) -> Response:
    return _json(adapter_api.listing(adapter_api.adapters_of(_registry().get(model_name)), _query()))


@blueprint.get("/models/<model_name>/adapters/<adapter_name>")
def describe_adapter(model_name: str, adapter_name: str) -> Response:
    adapters = adapter_api.adapters_of(_registry().get(model_name))
    return _json([adapter_api.describe(adapters.get(adapter_name))])


@blueprint.post("/models/<model_name>/adapters/<adapter_name>/update")
@management_route
def update_adapter(model_name: str, adapter_name: str) -> Response:
    service = _registry().get(model_name)
    adapters = adapter_api.adapters_of(service)
    try:
        return _json(adapter_api.update(adapters, adapter_name, _query(), _adapters_root(service)))
    except SourceRefused as exc:
        return error_response(403, "ForbiddenException", str(exc))


@blueprint.delete("/models/<model_name>/adapters/<adapter_name>")
@management_route
def unregister_adapter(model_name: str, adapter_name: str) -> Response:
    adapter_api.adapters_of(_registry().get(model_name)).unregister(adapter_name)  # NotFound: 404
    return _json({"status": f"Adapter {adapter_name} unregistered"})
