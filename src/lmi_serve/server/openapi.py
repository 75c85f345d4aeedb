"""GET /openapi.json (OpenAPI 3.1) and GET /docs (swagger-ui, served from the swagger-ui-py package).

The document is built from the app's own URL map and `OPERATIONS`, a table of (Flask rule, method)
-> summary, request and response models. Request schemas are the pydantic models the routes
validate with (`model_json_schema`, JSON Schema 2020-12, which OpenAPI 3.1 uses as is); bodies a
route parses by hand (TGI's and LMI's envelopes around `GenerationParameters`, Triton's tensors)
and the responses are described by the small models in `openapi_models.py`. A rule the app serves
that the table lacks is left out of the document and logged, and a test compares both ways.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from flask import Blueprint, Flask, Response, current_app, json, send_from_directory
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from lmi_serve import __version__
from lmi_serve.dialects.anthropic.schema import CountTokensRequest, MessagesRequest
from lmi_serve.dialects.openai import scoring_schema as scoring
from lmi_serve.dialects.openai import tokenize as vllm_tokenize
from lmi_serve.dialects.openai.responses.request import ResponsesRequest
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from lmi_serve.server import openapi_models as doc
from lmi_serve.server.security import open_routes

log = logging.getLogger(__name__)

blueprint = Blueprint("docs", __name__)
_IGNORED_METHODS = {"HEAD", "OPTIONS"}
_RULE_ARGUMENT = re.compile(r"<(?:(?P<converter>[a-z_]+)(?:\((?P<args>[^)]*)\))?:)?(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)>")
_REF = "#/components/schemas/{model}"

Models = tuple[type[BaseModel], ...]


class Operation(NamedTuple):
    """One (rule, method): what it does, its body models (oneOf when several, none when the
    route reads no body), its 200 models and media types, and its dialect's error model."""

    summary: str
    tag: str
    errors: type[BaseModel]
    request: Models = ()
    response: Models = ()
    media: tuple[str, ...] = ("application/json",)
    description: str = ""
    model_query: bool = False  # `?model_name=` picks the model (LMI's and TGI's routes)


def _lmi(summary: str, **kw) -> Operation:
    return Operation(summary, "LMI / SageMaker", doc.LmiError, **kw)


def _tgi(summary: str, **kw) -> Operation:
    return Operation(summary, "TGI", doc.TgiError, **kw)


def _openai(summary: str, **kw) -> Operation:
    return Operation(summary, "OpenAI / vLLM", doc.OpenAIError, **kw)


def _anthropic(summary: str, **kw) -> Operation:
    return Operation(summary, "Anthropic", doc.AnthropicError, **kw)


def _triton(summary: str, **kw) -> Operation:
    return Operation(summary, "Triton / KServe v2", doc.TritonError, **kw)


def _model_routes(suffix: str, method: str, operation: Operation) -> dict[tuple[str, str], Operation]:
    """Triton's routes exist with and without `/versions/<version>` (triton.routes.model_route)."""
    return {(f"/v2/models/<model>{suffix}", method): operation,
            (f"/v2/models/<model>/versions/<version>{suffix}", method): operation}


_STREAM = ("application/json", "text/event-stream")
_PREDICT = _lmi("Generate or embed with the model's handler",
                request=(doc.LmiRequest, doc.LmiDynamicBatchRequest), response=(doc.LmiGeneration,),
                media=("application/json", "application/jsonlines", "text/event-stream"),
                description="The rolling-batch schema (`parameters`: GenerationParameters), the dynamic-batch "
                            "schema (DynamicBatchParameters), an embedding request, a chat request (`messages`) or "
                            "a text/plain prompt; a custom model.py defines its own body.")
_INVOKE = _PREDICT._replace(model_query=True)
_TRITON_INFER = _triton("Infer (JSON, or the binary tensor data extension)", request=(doc.InferRequest,),
                        response=(doc.InferResponse,), media=("application/json", "application/octet-stream"))

OPERATIONS: dict[tuple[str, str], Operation] = {
    # LMI / SageMaker
    ("/ping", "GET"): _lmi("Health of every model", response=(doc.PingResponse,)),
    ("/execution-parameters", "GET"): _lmi("Batch Transform's defaults: concurrent requests, MULTI_RECORD, "
                                           "payload MB", response=(doc.ExecutionParameters,)),
    ("/invocations", "POST"): _INVOKE,
    ("/predictions/<model_name>", "POST"): _PREDICT,
    ("/predictions/<model_name>/<version>", "POST"): _PREDICT,
    ("/models", "GET"): _lmi("List the served models", response=(doc.LmiModelList,),
                             description="Query parameters: `limit` (default 100), `next_page_token`."),
    # SageMaker multi-model endpoints (SAGEMAKER_MULTI_MODEL) and DJL's register API (dialects/lmi/models_api.py)
    ("/models", "POST"): _lmi(
        "Load a model", request=(doc.LoadModelRequest,), response=(doc.LmiStatus,),
        description="Multi-model mode: the JSON body `{model_name, url}` (a folder under option.model_url_root); "
                    "409 when the name is loaded, 507 when it would not fit option.mme_memory_limit. Otherwise "
                    "DJL's register API, a management route: query parameters `url`, `model_name`."),
    ("/models/<model_name>", "DELETE"): _lmi(
        "Unload a model", response=(doc.LmiStatus,),
        description="Requests in flight get the graceful timeout to finish. A management route unless in "
                    "multi-model mode."),
    ("/models/<model_name>/invoke", "POST"): _lmi(
        "Invoke one model (SageMaker multi-model endpoints)", request=(doc.LmiRequest,),
        response=(doc.LmiGeneration,), media=("application/json", "application/jsonlines"),
        description="As /invocations, for the model the path names; X-Amzn-SageMaker-Target-Model is logged."),
    ("/models/<model_name>", "GET"): _lmi("Describe one model", response=(doc.LmiModelDescription,)),
    # DJL's LoRA adapters management API (option.enable_lora)
    ("/models/<model_name>/adapters", "POST"): _lmi(
        "Register a LoRA adapter", response=(doc.LmiStatus,),
        description="Query parameters: `name`, `src` (a local PEFT adapter folder), `preload` (default true), "
                    "`pin` (default false). 409 when the name is taken, 400 for a bad folder or a rank over "
                    "option.max_lora_rank; 403 while option.enable_management_api is off, or for a `src` "
                    "outside option.adapters_root."),
    ("/models/<model_name>/adapters", "GET"): _lmi(
        "List the model's LoRA adapters", response=(doc.LmiAdapterList,),
        description="Query parameters: `limit` (default 100), `next_page_token`."),
    ("/models/<model_name>/adapters/<adapter_name>", "GET"): _lmi("Describe one LoRA adapter",
                                                                  response=(doc.LmiAdapter,)),
    ("/models/<model_name>/adapters/<adapter_name>/update", "POST"): _lmi(
        "Load a new version of a LoRA adapter", response=(doc.LmiStatus,),
        description="Query parameters: `src` (default: the folder it came from), `preload`, `pin`. 403 while "
                    "option.enable_management_api is off, or for a `src` outside option.adapters_root."),
    ("/models/<model_name>/adapters/<adapter_name>", "DELETE"): _lmi(
        "Unregister a LoRA adapter (its weights go once the requests using it finish)", response=(doc.LmiStatus,),
        description="403 while option.enable_management_api is off."),
    # TGI
    ("/", "POST"): _tgi("Generate (a one-element array), or stream with `stream`", request=(doc.TgiRequest,),
                        response=(doc.TgiGenerateResponse,), media=_STREAM, model_query=True),
    ("/generate", "POST"): _tgi("Generate", request=(doc.TgiRequest,), response=(doc.TgiGenerateResponse,),
                                model_query=True),
    ("/generate_stream", "POST"): _tgi("Generate as server-sent StreamResponse events", request=(doc.TgiRequest,),
                                       response=(doc.TgiStreamResponse,), media=("text/event-stream",),
                                       model_query=True),
    ("/", "GET"): _tgi("Health (200 with an empty body when every model is ready)", response=()),
    ("/health", "GET"): _tgi("Health (200 with an empty body when every model is ready)", response=()),
    ("/info", "GET"): _tgi("Model information", response=(doc.TgiInfo,), model_query=True),
    # OpenAI / vLLM
    ("/v1/chat/completions", "POST"): _openai("Chat completion", request=(ChatCompletionRequest,),
                                              response=(doc.ChatCompletion,), media=_STREAM),
    ("/v1/completions", "POST"): _openai("Completion", request=(CompletionRequest,), response=(doc.Completion,),
                                         media=_STREAM),
    ("/v1/embeddings", "POST"): _openai("Embeddings", request=(EmbeddingRequest,), response=(doc.EmbeddingList,)),
    ("/v1/responses", "POST"): _openai(
        "Create a response (OpenAI's Responses API)", request=(ResponsesRequest,),
        response=(doc.ResponseObject, doc.ResponseStreamEvent), media=_STREAM,
        description="With `stream`, server-sent events named by their `type`. See docs/openai.md for the "
                    "fields honoured and refused."),
    ("/v1/responses/<response_id>", "GET"): _openai(
        "A stored response", response=(doc.ResponseObject,),
        description="Stored in this worker's memory (option.responses_store_size): a 404 once dropped, after "
                    "a restart, or when another worker stored it."),
    ("/v1/responses/<response_id>", "DELETE"): _openai("Delete a stored response",
                                                        response=(doc.ResponseDeleted,)),
    ("/v1/models", "GET"): _openai("List the served models", response=(doc.OpenAIModelList,)),
    ("/v1/models/<path:name>", "GET"): _openai("One model", response=(doc.OpenAIModel,)),
    ("/tokenize", "POST"): _openai(
        "Tokenize (vLLM's prompt or messages body; TGI's when the body has `inputs`)",
        request=(vllm_tokenize.TokenizeCompletionRequest, vllm_tokenize.TokenizeChatRequest, doc.TgiRequest),
        response=(vllm_tokenize.TokenizeResponse, doc.TgiTokenList),
        description="A TGI body answers TGI's token list and errors in TGI's shape (TgiError); "
                    "`model_name` picks its model, as on TGI's other routes.", model_query=True),
    ("/detokenize", "POST"): _openai("Token ids to text", request=(vllm_tokenize.DetokenizeRequest,),
                                     response=(vllm_tokenize.DetokenizeResponse,)),
    **{(path, "POST"): _openai("Score text pairs with a cross-encoder (vLLM)", request=(scoring.ScoreRequest,),
                               response=(scoring.ScoreResponse,)) for path in ("/score", "/v1/score")},
    **{(path, "POST"): _openai("Rerank documents for a query (vLLM, Jina, Cohere)", request=(scoring.RerankRequest,),
                               response=(scoring.RerankResponse,)) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    **{(path, "POST"): _openai("Classify texts (vLLM)", request=(scoring.ClassifyRequest,),
                               response=(scoring.ClassifyResponse,)) for path in ("/classify", "/v1/classify")},
    # Anthropic
    ("/v1/messages", "POST"): _anthropic("Create a message (Anthropic's Messages API)", request=(MessagesRequest,),
                                         response=(doc.AnthropicMessage,), media=_STREAM,
                                         description="A stream (`stream: true`) is SSE events named by type. "
                                                     "Headers anthropic-version and anthropic-beta are accepted."),
    ("/v1/messages/count_tokens", "POST"): _anthropic("Count a message's input tokens",
                                                      request=(CountTokensRequest,),
                                                      response=(doc.AnthropicTokenCount,)),
    # Triton / KServe v2
    ("/v2", "GET"): _triton("Server metadata", response=(doc.ServerMetadata,)),
    ("/v2/health/live", "GET"): _triton("Liveness"),
    ("/v2/health/ready", "GET"): _triton("Readiness of every model"),
    **_model_routes("", "GET", _triton("Model metadata", response=(doc.ModelMetadata,))),
    **_model_routes("/ready", "GET", _triton("Model readiness")),
    **_model_routes("/config", "GET", _triton("Model configuration", response=(doc.JsonObject,))),
    **_model_routes("/stats", "GET", _triton("Model statistics", response=(doc.ModelStats,))),
    ("/v2/models/stats", "GET"): _triton("Every model's statistics", response=(doc.ModelStats,)),
    ("/v2/repository/index", "POST"): _triton("Repository index", request=(doc.RepositoryIndexRequest,),
                                              response=(doc.RepositoryIndex,)),
    ("/v2/repository/<repository>/index", "POST"): _triton("Repository index", request=(doc.RepositoryIndexRequest,),
                                                           response=(doc.RepositoryIndex,)),
    ("/v2/trace/setting", "GET"): _triton("Trace settings", response=(doc.JsonObject,)),
    ("/v2/trace/setting", "POST"): _triton("Update trace settings", request=(doc.JsonObject,),
                                           response=(doc.JsonObject,)),
    **_model_routes("/trace/setting", "GET", _triton("A model's trace settings", response=(doc.JsonObject,))),
    **_model_routes("/trace/setting", "POST", _triton("Update a model's trace settings", request=(doc.JsonObject,),
                                                       response=(doc.JsonObject,))),
    ("/v2/repository/models/<model>/<any(load, unload):action>", "POST"):
        _triton("Load or unload (refused: models are loaded at start-up)", request=(doc.JsonObject,)),
    ("/v2/repository/<repository>/models/<model>/<any(load, unload):action>", "POST"):
        _triton("Load or unload (refused: models are loaded at start-up)", request=(doc.JsonObject,)),
    **_model_routes("/infer", "POST", _TRITON_INFER),
    **_model_routes("/generate", "POST", _triton("Generate (Triton's generate extension)",
                                                 request=(doc.JsonObject,), response=(doc.JsonObject,))),
    **_model_routes("/generate_stream", "POST", _triton("Generate as server-sent events", request=(doc.JsonObject,),
                                                        response=(doc.JsonObject,), media=("text/event-stream",))),
    # Operations
    ("/metrics", "GET"): Operation("Prometheus metrics (text format 0.0.4)", "Operations", doc.LmiError,
                                   media=("text/plain",), response=()),
    ("/openapi.json", "GET"): Operation("This document", "Operations", doc.LmiError, response=(doc.JsonObject,)),
    ("/docs", "GET"): Operation("This document, rendered by swagger-ui", "Operations", doc.LmiError,
                                media=("text/html",)),
    ("/docs/static/<path:filename>", "GET"): Operation("swagger-ui's files", "Operations", doc.LmiError,
                                                       media=("application/octet-stream",)),
}

def served_operations(app: Flask) -> set[tuple[str, str]]:
    """Every (rule, method) the app serves, except Flask's own /static."""
    return {(rule.rule, method) for rule in app.url_map.iter_rules() if rule.endpoint != "static"
            for method in rule.methods - _IGNORED_METHODS}


def openapi_path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    """A Flask rule as an OpenAPI path template, with its path parameters."""
    parameters = []

    def replace(match: re.Match) -> str:
        schema: dict[str, Any] = {"type": "string"}
        if match["converter"] == "any":
            schema["enum"] = [value.strip() for value in match["args"].split(",")]
        parameters.append({"name": match["name"], "in": "path", "required": True, "schema": schema})
        return "{" + match["name"] + "}"

    return _RULE_ARGUMENT.sub(replace, rule), parameters


def _one_of(models: Models) -> dict[str, Any]:
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    return refs[0] if len(refs) == 1 else {"oneOf": refs}


def _operation(op: Operation, parameters: list[dict], operation_id: str) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "Success"}
    if op.response or op.media != ("application/json",):
        schema = _one_of(op.response) if op.response else {}
        ok["content"] = {media: {"schema": schema if media == "application/json" else {}} for media in op.media}
    body: dict[str, Any] = {"summary": op.summary, "operationId": operation_id, "tags": [op.tag],
                            "responses": {"200": ok, "default": {
                                "description": "An error, in the dialect's shape",
                                "content": {"application/json": {"schema": _one_of((op.errors,))}}}}}
    if op.description:
        body["description"] = op.description
    if op.model_query:
        parameters = [*parameters, {"name": "model_name", "in": "query", "required": False,
                                    "schema": {"type": "string"}, "description": "the model to use (default: the "
                                    "only model, else the first text-generation model)"}]
    if parameters:
        body["parameters"] = parameters
    if op.request:
        body["requestBody"] = {"required": True, "content": {"application/json": {"schema": _one_of(op.request)}}}
    return body


def _schemas() -> dict[str, Any]:
    models = {m for op in OPERATIONS.values() for m in (*op.request, *op.response, op.errors)}
    _, schema = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                   ref_template=_REF)
    return schema["$defs"]


def build_document(app: Flask) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route `app` serves that OPERATIONS describes."""
    paths: dict[str, dict[str, Any]] = {}
    for rule, method in sorted(served_operations(app)):
        op = OPERATIONS.get((rule, method))
        if op is None:
            log.warning("Route %s %s is not described in openapi.OPERATIONS; /openapi.json leaves it out",
                        method, rule)
            continue
        path, parameters = openapi_path(rule)
        operation_id = f"{method.lower()}_{re.sub(r'[^a-zA-Z0-9]+', '_', path).strip('_') or 'root'}"
        paths.setdefault(path, {})[method.lower()] = _operation(op, parameters, operation_id)
    document = {"openapi": "3.1.0",
                "info": {"title": "lmi-serve", "version": __version__,
                         "description": "One server, five dialects: LMI / SageMaker, TGI, OpenAI (with vLLM's "
                                        "extensions), Anthropic's Messages API and Triton / KServe v2."},
                "paths": paths, "components": {"schemas": _schemas()}}
    access = app.extensions.get("lmi_serve.server.security")
    if access is not None and access.keys_required:  # API keys (security.py): every route but the exempt ones
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"},
                                                     "apiKeyHeader": {"type": "apiKey", "in": "header",
                                                                      "name": "x-api-key"}}
        document["security"] = [{"apiKey": []}, {"apiKeyHeader": []}]  # either one
        for rule, method in served_operations(app) & set(OPERATIONS):
            if (rule, method) in open_routes(access):
                paths[openapi_path(rule)[0]][method.lower()]["security"] = []
    return document


@lru_cache(maxsize=1)
def swagger_ui_dir() -> Path:
    """swagger-ui's distribution files inside the swagger-ui-py package (found without importing it)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or spec.origin is None:
        raise RuntimeError("the swagger-ui-py package is not installed")
    return Path(spec.origin).parent / "static"


_DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>lmi-serve API</title>
<link rel="stylesheet" href="/docs/static/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script src="/docs/static/swagger-ui-standalone-preset.js"></script>
<script>
window.onload = function () {
  window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui",
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout"});
};
</script>
</body>
</html>
"""

@blueprint.get("/openapi.json")
def openapi_document() -> Response:
    document = current_app.extensions.get("lmi_serve.server.openapi")
    if document is None:  # the URL map is complete once the app serves: build once per worker
        document = current_app.extensions["lmi_serve.server.openapi"] = json.dumps(build_document(current_app))
    return Response(document, mimetype="application/json")


@blueprint.get("/docs")
def docs_page() -> Response:
    return Response(_DOCS_PAGE, mimetype="text/html")


@blueprint.get("/docs/static/<path:filename>")
def docs_static(filename: str) -> Response:
    return send_from_directory(swagger_ui_dir(), filename)
