"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

`model` selects the model as on the OpenAI routes (openai/model_choice.py: an unknown name selects
the only text-generation model, so a client configured with Claude's model names works against one
served model). The `anthropic-version` and `anthropic-beta` headers are accepted and read no further:
a beta feature is asked for by fields, which are honoured or refused by name. Errors are Anthropic's
envelope (errors.py); streams are SSE events named by their type.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, request

from lmi_serve import json_body
from lmi_serve.dialects.anthropic.errors import render_kind
from lmi_serve.dialects.anthropic.schema import CountTokensRequest, MessagesRequest, parse
from lmi_serve.dialects.anthropic.service import MessagesService
from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.openai.model_choice import chat_service
from lmi_serve.errors import ServingError
from lmi_serve.json_body import InvalidJson

blueprint = Blueprint("anthropic", __name__, url_prefix="/v1/messages")
ERROR_PREFIXES = ("/v1/messages",)
_ROUTES = "the Anthropic routes"


@blueprint.errorhandler(ServingError)
@blueprint.errorhandler(InvalidJson)
def _serving_error(exc: ServingError | InvalidJson) -> Response:
    # app.py renders kinds by URL too; this keeps the blueprint whole on its own (unit tests mount it alone)
    return render_kind(exc)


def _json(body: dict) -> Response:
    return Response(json.dumps(body), mimetype="application/json")


@blueprint.post("")
def create_message() -> Response:
    parsed = parse(MessagesRequest, json_body.loads(request.get_data()))
    reply = MessagesService(chat_service(parsed.model, _ROUTES)).create(parsed)
    if reply.events is None:
        return _json(reply.body)
    return Response(streaming.sse_named(reply.events), mimetype=streaming.SSE_MIMETYPE, headers=streaming.SSE_HEADERS)


@blueprint.post("/count_tokens")
def count_tokens() -> Response:
    parsed = parse(CountTokensRequest, json_body.loads(request.get_data()))
    return _json(MessagesService(chat_service(parsed.model, _ROUTES)).count_tokens(parsed))
