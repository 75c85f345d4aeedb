"""A Responses request -> the chat completion request the chat service answers, and the chat
service's errors back in the Responses request's own field names.

`input` (with the history of `previous_response_id`) and `instructions` become messages (items.py);
`max_output_tokens` is `max_completion_tokens` (reasoning tokens count in it, as OpenAI counts them);
`text.format` is `response_format`; flat function tools become chat tools; `reasoning.effort` sets the
chat template's switch where it has one (`effort_kwargs`). Streams ask for the usage chunk, which the
Responses stream's last event carries.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from lmi_serve.dialects.openai.responses.items import Conversation
from lmi_serve.dialects.openai.responses.request import FunctionChoice, ResponsesRequest
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.errors import InvalidRequest, ServingError

# gpt-oss' template reads `reasoning_effort` and knows low, medium and high.
_EFFORT_LEVELS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                  "xhigh": "high", "max": "high"}
_THINKING_OFF = ("none", "minimal")


def _template_text(template) -> str:
    if isinstance(template, dict):  # named templates: any of them may hold the switch
        return " ".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def effort_kwargs(effort: str | None, template, reasoner: bool) -> dict | None:
    """The chat template variables `reasoning.effort` maps to: gpt-oss' `reasoning_effort` (low,
    medium, high), Qwen3's `enable_thinking` (off for none and minimal). A model that does not reason
    honours none and minimal as it is; any other effort it, or a reasoning model without a switch,
    cannot honour is a 400."""
    if effort is None:
        return None
    text = _template_text(template)
    if "reasoning_effort" in text:
        return {"reasoning_effort": _EFFORT_LEVELS[effort]}
    if "enable_thinking" in text:
        return {"enable_thinking": effort not in _THINKING_OFF}
    if not reasoner and effort in _THINKING_OFF:
        return None
    what = "reasons without a switch in its chat template" if reasoner else "does not reason"
    raise InvalidRequest(f"reasoning.effort: {effort!r} cannot be honoured: this model {what}; leave effort out"
                         + ("" if reasoner else " or send 'none'"), param="reasoning.effort")


def _response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text_format
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _tools(request: ResponsesRequest) -> tuple[list[dict] | None, object]:
    """(chat tools, chat tool_choice); no tools (or an empty list): neither."""
    if not request.tools:
        return None, None
    tools = [{"type": "function", "function": {k: v for k, v in {
        "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}.items()
        if v is not None}} for t in request.tools]
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return tools, choice


def chat_request(request: ResponsesRequest, conversation: Conversation, template, reasoner: bool
                 ) -> ChatCompletionRequest:
    """The chat completion request answering `request` over `conversation`; `template` is the model's
    chat template and `reasoner` whether its output may hold a reasoning block."""
    tools, choice = _tools(request)
    body = {
        "model": request.model, "messages": conversation.messages, "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k, "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty, "seed": request.seed, "stop": request.stop,
        "ignore_eos": request.ignore_eos or None,
        "tools": tools, "tool_choice": choice, "response_format": _response_format(request),
        "chat_template_kwargs": effort_kwargs(request.reasoning and request.reasoning.effort, template, reasoner),
        "stream": request.stream, "stream_options": {"include_usage": True} if request.stream else None,
    }
    if request.parallel_tool_calls is not None and tools:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    with responses_names(conversation):
        return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


# ---- errors, named as the Responses request has them ----------------------------------------------

_FIELDS = [
    (re.compile(r"\b(max_completion_tokens|max_tokens)\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?(\.schema)?\b"), "text.format"),
    (re.compile(r"\btools\.(\d+)\.function\b"), r"tools.\1"),
    (re.compile(r"\bchat_template_kwargs\b"), "reasoning.effort"),
    (re.compile(r"\bcontent\[(\d+)\]"), r"content.\1"),  # the dotted paths items.py names parts with
]
_MESSAGE = re.compile(r"\bmessages(?:\[(\d+)\]|\.(\d+))?")


def renamed(text: str, origins: list[str]) -> str:
    """`text` with the chat request's field names put as the Responses request's: a message by the
    item (or `instructions`, `previous_response_id`) it came from."""
    for pattern, name in _FIELDS:
        text = pattern.sub(name, text)

    def origin(match: re.Match) -> str:
        index = match.group(1) or match.group(2)
        if index is None:
            return "input"
        return origins[int(index)] if int(index) < len(origins) else "input"

    return _MESSAGE.sub(origin, text)


@contextmanager
def responses_names(conversation: Conversation) -> Iterator[None]:
    """Errors raised inside name the Responses request's fields (the same error, its words adjusted)."""
    try:
        yield
    except ServingError as exc:
        exc.message = renamed(exc.message, conversation.origins)
        exc.args = (exc.message,)
        if exc.param:
            exc.param = renamed(exc.param, conversation.origins)
        raise
