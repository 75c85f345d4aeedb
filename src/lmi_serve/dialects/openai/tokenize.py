"""POST /tokenize and /detokenize: vLLM's shapes, and TGI's /tokenize on the same path.

- vLLM: `{"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?: false}` or
  `{"model"?, "messages", "add_generation_prompt"?: true, "continue_final_message"?: false,
  "add_special_tokens"?: false, "tools"?, "chat_template_kwargs"?, "chat_template"?, "return_token_strs"?}` ->
  `{"count", "max_model_len", "tokens", "token_strs"?}`; `{"model"?, "tokens"}` -> `{"prompt"}`.
  The model is chosen as on /v1 (`routes.choose_service`); errors in OpenAI's envelope.
- TGI: a body with `inputs` (TGI's GenerateRequest) is TGI's, answered by `tgi.routes.tokenize`
  as `[{"id", "text", "start", "stop"}]` with TGI's errors.

The messages go through the same chat template as a chat completion (`chat.render_prompt`); the
ids are the model's tokenizer's, exactly what a generation request would be given.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, g, json, request
from pydantic import Field, field_validator, model_validator

from lmi_serve import json_body
from lmi_serve.json_body import InvalidJson
from lmi_serve.dialects.openai import chat, images
from lmi_serve.dialects.openai.errors import render_kind
from lmi_serve.dialects.openai.generation import check_token_ids
from lmi_serve.dialects.openai.routes import choose_service
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, ChatMessage, Tool, TokenId, _Lenient, parse
from lmi_serve.dialects.openai.templates import check_request_template, check_template_kwargs, trusts_request_template
from lmi_serve.dialects.tgi import protocol as tgi_protocol
from lmi_serve.dialects.tgi import routes as tgi_routes
from lmi_serve.errors import InvalidRequest, ServingError

blueprint = Blueprint("tokenize", __name__)
ERROR_PREFIXES = ("/tokenize", "/detokenize")  # app-level 404/405/413 there: OpenAI's envelope

class TokenizeCompletionRequest(_Lenient):
    """vLLM's /tokenize for a prompt text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Lenient):
    """vLLM's /tokenize for a conversation, rendered by the model's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=32)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # honoured where the model trusts requests' templates, else a 400

    @model_validator(mode="after")
    def _template_rules(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second opens a new assistant turn")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_rule(cls, value):
        return check_template_kwargs(value)  # as on chat completions


class TokenizeResponse(_Lenient):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Lenient):
    prompt: str


@blueprint.errorhandler(ServingError)
@blueprint.errorhandler(InvalidJson)
def _serving_error(exc: ServingError | InvalidJson) -> Response:
    """A TGI body's errors in TGI's shape; every other one in OpenAI's (vLLM's) envelope."""
    if g.get("tokenize_dialect") == "tgi":
        return tgi_protocol.render_kind(exc)
    return render_kind(exc)


def _body() -> Any:
    return json_body.loads(request.get_data())  # decoded before the dialect is known: OpenAI's 400


def _service(name: str | None):
    strict = current_app.config.get("STRICT_MODEL_NAMES", False)
    return choose_service(current_app.extensions["lmi_serve.serving.registry"].services, name, "text-generation",
                          strict=strict)


def _engine(service):
    return service.rolling_engine("/tokenize and /detokenize", param="model")


def _reply(body: dict) -> Response:
    return Response(json.dumps(body), mimetype="application/json")


def chat_prompt_ids(tokenizer, parsed: TokenizeChatRequest, trusted: bool = False) -> list[int]:
    """The ids a chat completion with these messages (and tools) would be given, with vLLM's
    template switches; `trusted`: the model's option.trust_request_chat_template, as on chat."""
    request_template = check_request_template(parsed, trusted)
    conversation = ChatCompletionRequest.model_validate(
        {"messages": [m.model_dump(exclude_none=True) for m in parsed.messages],
         "tools": [t.model_dump(exclude_none=True) for t in parsed.tools] if parsed.tools else None})
    found = images.image_parts(conversation)
    if found:  # the ids depend on the processor's expansion of each image, which /tokenize does not run
        raise InvalidRequest(f"{found[0][1]}: /tokenize takes text parts only", param=found[0][1])
    text = chat.render_prompt(tokenizer, conversation, add_generation_prompt=parsed.add_generation_prompt,
                              continue_final_message=parsed.continue_final_message,
                              template_kwargs=parsed.chat_template_kwargs, request_template=request_template)
    return tokenizer(text, add_special_tokens=parsed.add_special_tokens).input_ids


@blueprint.post("/tokenize")
def tokenize() -> Response:
    body = _body()
    if isinstance(body, dict) and "inputs" in body and "prompt" not in body and "messages" not in body:
        g.tokenize_dialect = "tgi"
        return tgi_routes.tokenize()
    if isinstance(body, dict) and "messages" in body:
        parsed = parse(TokenizeChatRequest, body)
        service = _service(parsed.model)
        engine = _engine(service)
        ids = chat_prompt_ids(engine.tokenizer, parsed, trusted=trusts_request_template(service))
    else:
        parsed = parse(TokenizeCompletionRequest, body)
        engine = _engine(_service(parsed.model))
        ids = engine.tokenizer(parsed.prompt, add_special_tokens=parsed.add_special_tokens).input_ids
    reply = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}
    if parsed.return_token_strs:
        reply["token_strs"] = engine.tokenizer.convert_ids_to_tokens(list(ids))
    return _reply(reply)


@blueprint.post("/detokenize")
def detokenize() -> Response:
    parsed = parse(DetokenizeRequest, _body())
    engine = _engine(_service(parsed.model))
    check_token_ids(parsed.tokens, len(engine.tokenizer), "tokens")
    return _reply({"prompt": engine.tokenizer.decode(parsed.tokens)})
