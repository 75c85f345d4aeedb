"""Chat specifics: messages -> prompt text, response_format/tools -> a grammar, text -> tool calls.

Tool calls travel as text the model writes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes convention many chat templates use). When the model's chat template knows `tools`
they are passed to it; otherwise a system message lists them and describes that format. A grammar
then keeps the output honest:
- `required` / a named function: only tool calls, arguments valid against the function's schema;
- `auto`: either a tool call (as above) or text that does not start with `<` (or, with a
  response_format, a JSON document);
- `none`: no tools in the prompt; text that does not start with `<` (no call can be written).
Assistant messages with `tool_calls` are rendered back in the same format, and `tool` messages
through the template with their role, so a round trip reads naturally to the model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.common import json_body
from lmi_serve.dialects.common.json_body import InvalidJson
from lmi_serve.dialects.openai import vllm
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, NamedToolChoice, Tool
from lmi_serve.engine.types import GuidedDecoding
from lmi_serve.errors import InvalidRequest

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The layout the grammar enforces inside embedded JSON (see engine/sampling/grammar.py).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Text that cannot be mistaken for a tool call: it does not start with `<`.
_TEXT_RULE = "TEXT: /[^<](.|\\n)*/"


def _call_text(name: str, arguments) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': _arguments_value(arguments)})}{CALL_CLOSE}"


def _arguments_value(arguments):
    """A call's arguments as JSON: the decoded JSON string, or, when it does not decode (OpenAI
    accepts any string there, e.g. a model's broken output replayed), the string itself."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json_body.loads(arguments)  # bounded depth: the body's limit does not reach inside strings
    except InvalidJson:
        return arguments


def _tool_instructions(tools: list[Tool], choice) -> str:
    listing = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                    "parameters": t.function.parameters or {"type": "object", "properties": {}}})
                        for t in tools)
    when = {"required": "You must call one of these functions.",
            "auto": "Call a function only when it helps to answer; otherwise answer in plain text."}
    rule = (f"You must call the function {choice.function['name']}." if isinstance(choice, NamedToolChoice)
            else when.get(choice, ""))
    return (f"You have access to these functions:\n{listing}\n{rule}\nTo call a function, reply with "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CALL_CLOSE}')


def template_messages(request: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    """The conversation as plain dicts with string content, ready for apply_chat_template."""
    messages = []
    for message in request.messages:
        content = message.text
        if message.tool_calls:
            content += "".join(_call_text(c.function.name, c.function.arguments) for c in message.tool_calls)
        role = "system" if message.role == "developer" else message.role
        if role == "tool" and not template_knows_tools:
            # A template without tool support has no tool turn the model was trained on; a user turn
            # carrying the result (as Qwen's and Hermes' templates render it) reads naturally.
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        entry = {"role": role, "content": content}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        thought = (message.model_extra or {}).get("reasoning_content")  # a reply sent back: Qwen3's template reads it
        if role == "assistant" and isinstance(thought, str):
            entry["reasoning_content"] = thought
        messages.append(entry)
    choice = request.effective_tool_choice
    if request.tools and choice != "none" and not template_knows_tools:
        instructions = _tool_instructions(request.tools, choice)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages


def render_prompt(tokenizer, request: ChatCompletionRequest, *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """The conversation as prompt text through the model's chat template. The keywords are vLLM's
    (its /tokenize takes them); a chat completion always opens the assistant's turn.
    `template_kwargs` defaults to the request's `chat_template_kwargs`."""
    if template_kwargs is None:
        template_kwargs = getattr(request, "chat_template_kwargs", None)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest("This model has no chat template; use /v1/completions", param="messages")
    knows_tools = isinstance(template, str) and "tools" in template
    messages = template_messages(request, knows_tools)
    extra = {}
    if knows_tools and request.tools and request.effective_tool_choice != "none":
        extra["tools"] = [tool.function.model_dump(exclude_none=True) for tool in request.tools]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}), **extra)
    except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
        raise InvalidRequest(f"The chat template rejected the messages: {exc}", param="messages") from None


def _call_schema(tools: list[Tool]) -> dict:
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name},
                               "arguments": t.function.parameters or {"type": "object", "properties": {}}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    return {"anyOf": options, "x-guidance": _LAYOUT}


def response_constraint(request: ChatCompletionRequest) -> GuidedDecoding | None:
    """What `response_format` asks for: OpenAI's `json_object` / `json_schema`, and TGI's Messages
    API forms (`json_object` or `json` with the schema in `value`, `regex` with a pattern there)."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "regex":
        return guided.regex(fmt.value, "response_format.value")
    if fmt.type == "json_schema":
        return guided.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    if fmt.value is None:  # json_object without a schema: any object
        return guided.any_object()
    return guided.json_schema(fmt.value, "response_format.value")


def guided_decoding(request: ChatCompletionRequest) -> GuidedDecoding | None:
    """The grammar the output must follow, or None for free text."""
    constraint = response_constraint(request)
    choice = request.effective_tool_choice
    if constraint is not None and (not request.tools or choice == "none"):
        return constraint
    if constraint is not None and constraint.json_schema is None:
        raise InvalidRequest("response_format: a regex cannot be combined with tools; use a JSON schema or "
                             "tool_choice none", param="response_format")
    schema = json.loads(constraint.json_schema) if constraint is not None else None
    if not request.tools:
        return None
    if choice == "none":  # tools are known to the conversation but must not be called
        return GuidedDecoding(lark=f"start: TEXT\n{_TEXT_RULE}\n")
    tools = request.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function["name"]]
    repeat = "+" if request.parallel_tool_calls else ""
    rules = [f"calls: call{repeat}",
             f'call: "{CALL_OPEN}" %json {json.dumps(_call_schema(tools))} "{CALL_CLOSE}"']
    if choice == "auto":
        if schema is not None:
            rules.insert(0, f"start: calls | %json {json.dumps({**schema, 'x-guidance': _LAYOUT})}")
        else:
            rules.insert(0, "start: calls | TEXT")
            rules.append(_TEXT_RULE)
    else:
        rules.insert(0, "start: calls")
    return GuidedDecoding(lark="\n".join(rules) + "\n")


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split generated text into content and tool calls (`arguments` as a JSON string). Text that
    is not a whole tool call stays content."""
    stripped = text.lstrip()
    if not stripped.startswith(CALL_OPEN):
        return ParsedOutput(text, [])
    calls, rest = [], stripped
    while rest.startswith(CALL_OPEN) and CALL_CLOSE in rest:
        body, rest = rest[len(CALL_OPEN):].split(CALL_CLOSE, 1)
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return ParsedOutput(text, [])
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments)}})
        rest = rest.lstrip()
    if rest:  # an unfinished call (e.g. cut by max_tokens) leaves it all as content
        return ParsedOutput(text, [])
    return ParsedOutput(None, calls)

