"""LMI / SageMaker routes: /ping, /invocations, /predictions/<model>, /models.

Routes turn HTTP into an `Input`, hand it to the model's job queue, and turn the handler's
`Output` back into HTTP. They never parse the body: that is the handler's job (as in DJL).
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, current_app, g, request

from ...handler_api import Input, Output
from ...registry import ModelRegistry
from ...service import ModelService

blueprint = Blueprint("lmi", __name__)

JSON = "application/json"
# Hop-by-hop and framing headers are Werkzeug's to set, never a handler's.
_RESERVED_HEADERS = {"content-length", "transfer-encoding", "connection"}


def error_response(status: int, error_type: str, message: str) -> Response:
    """LMI's management-style error body, plus `error` (the message again): the LMI renderer also
    answers paths no dialect owns, and clients of the other dialects (the `text-generation`
    client, for one) read `error` from any error body."""
    body = {"code": status, "type": error_type, "message": message, "error": message}
    return Response(json.dumps(body), status=status, mimetype=JSON)


def _registry() -> ModelRegistry:
    return current_app.extensions["lmi_serve.registry"]


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
    return Response(json.dumps(body), status=status, mimetype=JSON)


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
    models = [{"modelName": s.name, "modelUrl": s.config.model_dir or s.config.model_id,
               "status": s.current_status().value} for s in _registry().services.values()]
    return Response(json.dumps({"models": models}), mimetype=JSON)


@blueprint.get("/models/<model_name>")
def describe_model(model_name: str) -> Response:
    service = _registry().get(model_name)
    return Response(json.dumps([{"workflowName": service.name, "models": [service.describe()]}]), mimetype=JSON)
