"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/<id>` (OpenAI's Responses API, as vLLM serves it).

The model is chosen as on chat completions (model_choice.generation_target: a served name, a LoRA adapter,
or the only text-generation model); errors are OpenAI's envelope (errors.py). A stream is SSE with
each event's type as its `event:` name, as OpenAI sends it, and no `[DONE]`.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, current_app, request

from lmi_serve import json_body
from lmi_serve.config.server_options import ServerOptions
from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.openai.errors import render_kind
from lmi_serve.dialects.openai.responses.request import ResponsesRequest
from lmi_serve.dialects.openai.responses.service import ResponsesService
from lmi_serve.dialects.openai.responses.store import ResponseStore, find
from lmi_serve.dialects.openai.model_choice import generation_target, openai_service
from lmi_serve.dialects.openai.schema import parse
from lmi_serve.errors import InvalidRequest, ServingError
from lmi_serve.json_body import InvalidJson

blueprint = Blueprint("openai_responses", __name__, url_prefix="/v1")
_STORES = "lmi_serve.dialects.openai.responses"
_DEFAULT_SIZE = ServerOptions.model_fields["responses_store_size"].default


@blueprint.errorhandler(ServingError)
@blueprint.errorhandler(InvalidJson)
def _serving_error(exc: ServingError | InvalidJson) -> Response:
    return render_kind(exc)  # app.py renders kinds by URL too; this keeps the blueprint whole on its own


def _stores() -> dict[str, ResponseStore]:
    """This worker's stores, one per model (made on the model's first request)."""
    return current_app.extensions.setdefault(_STORES, {})


def _store_of(service) -> ResponseStore:
    size = getattr(getattr(service, "config", None), "responses_store_size", _DEFAULT_SIZE)
    return _stores().setdefault(service.name, ResponseStore(size))


def _json(body: dict) -> Response:
    return Response(json.dumps(body), mimetype="application/json")


@blueprint.post("/responses")
def create_response() -> Response:
    parsed: ResponsesRequest = parse(ResponsesRequest, json_body.loads(request.get_data()))
    service, adapter = generation_target(parsed.model)
    stores = _stores()
    answer = ResponsesService(openai_service(service, adapter), _store_of(service),
                              lambda: list(stores.values())).create(parsed)
    if isinstance(answer, dict):
        return _json(answer)
    return Response(streaming.sse_named(answer), mimetype=streaming.SSE_MIMETYPE, headers=streaming.SSE_HEADERS)


def _refuse_query() -> None:
    """GET's `stream` (a replay of the events) and `include` (extra data) cannot be honoured."""
    for name in ("stream", "include", "include[]", "starting_after"):
        value = request.args.get(name)
        if value not in (None, "", "false"):
            raise InvalidRequest(f"`{name}` is not supported when retrieving a response; it is returned whole",
                                 param=name)


@blueprint.get("/responses/<response_id>")
def get_response(response_id: str) -> Response:
    _refuse_query()
    return _json(find(list(_stores().values()), response_id)[1].response)


@blueprint.delete("/responses/<response_id>")
def delete_response(response_id: str) -> Response:
    store, _ = find(list(_stores().values()), response_id)
    store.delete(response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})
