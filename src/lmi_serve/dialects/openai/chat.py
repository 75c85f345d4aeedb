"""Chat specifics: messages -> prompt text, response_format/tools -> a grammar, text -> tool calls.

Tool calls travel as text the model writes, in its family's format (tool_formats/: Hermes
`<tool_call>` blocks, Llama 3 JSON, Mistral `[TOOL_CALLS]`, pythonic), chosen by
option.tool_call_parser or from the chat template. When the template knows `tools` they are passed
to it; otherwise a system message lists them and describes the format. A grammar then keeps the
output honest:
- `required` / a named function: only tool calls, arguments valid against the function's schema
  (several where `parallel_tool_calls` and the format allow);
- `auto`: either tool calls (as above) or text that cannot start a call (or, with a
  response_format, a JSON document);
- `none`: no tools in the prompt; text that cannot start a call.
Assistant messages with `tool_calls` go to a template that renders them itself as structured
calls, else into their content in the format; `tool` messages go through the template with their
role, so a round trip reads naturally to the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from lmi_serve.dialects.common import guided, reasoning
from lmi_serve.dialects.openai import tool_formats, vllm
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, NamedToolChoice, Tool
from lmi_serve.dialects.openai.tool_formats.base import LAYOUT as _LAYOUT
from lmi_serve.dialects.openai.tool_formats.base import NO_TOKENS, ToolFormat, arguments_value, text_rule
from lmi_serve.dialects.openai.tool_formats.hermes import CLOSE as CALL_CLOSE
from lmi_serve.dialects.openai.tool_formats.hermes import OPEN as CALL_OPEN
from lmi_serve.engine.types import GuidedDecoding
from lmi_serve.errors import InvalidRequest

__all__ = ["CALL_CLOSE", "CALL_OPEN"]

# A template that joins a past call's arguments to text with `+` (DeepSeek V3 / R1 / V3.1) needs
# them as a string: Jinja cannot add a mapping to a string.
_JOINS_ARGUMENTS = re.compile(r"""\[['"]arguments['"]\]\s*\+|\.arguments\s*\+""")


def joins_arguments(template) -> bool:
    """Whether `template` writes past calls' arguments by string concatenation (wants them as text)."""
    return isinstance(template, str) and _JOINS_ARGUMENTS.search(template) is not None


def tool_format_for(tokenizer, option: str | None = None) -> ToolFormat:
    """The tool-call format of a model: `option` (option.tool_call_parser) or its template's."""
    return tool_formats.choose(getattr(tokenizer, "chat_template", None), option)


def _tool_instructions(tools: list[Tool], choice, tool_format: ToolFormat) -> str:
    listing = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                    "parameters": t.function.parameters or {"type": "object", "properties": {}}})
                        for t in tools)
    when = {"required": "You must call one of these functions.",
            "auto": "Call a function only when it helps to answer; otherwise answer in plain text."}
    rule = (f"You must call the function {choice.function['name']}." if isinstance(choice, NamedToolChoice)
            else when.get(choice, ""))
    return f"You have access to these functions:\n{listing}\n{rule}\n{tool_format.instructions()}"


def template_messages(request: ChatCompletionRequest, template_knows_tools: bool,
                      tool_format: ToolFormat = tool_formats.DEFAULT, template_renders_calls: bool = False,
                      parts: bool = False, string_arguments: bool = False) -> list[dict]:
    """The conversation as plain dicts with string content, ready for apply_chat_template.
    Past calls go to a template that renders `tool_calls` as such (arguments decoded, as
    transformers' templates expect, or as the request's JSON text where `string_arguments`: a
    template that concatenates them); otherwise into the content, written in `tool_format`.
    `parts` (a vision-language model's template, which iterates content parts): every content a
    list of `{"type": "text"}` and `{"type": "image"}` parts, images where the request put them."""
    messages = []
    for message in request.messages:
        content = message.text
        calls = None
        if message.tool_calls and template_renders_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments,
                                                                                    string_arguments)}}
                     for c in message.tool_calls]
        elif message.tool_calls:
            content += tool_format.render_calls([(c.function.name, arguments_value(c.function.arguments))
                                                 for c in message.tool_calls])
        role = "system" if message.role == "developer" else message.role
        if role == "tool" and not template_knows_tools:
            # A template without tool support has no tool turn the model was trained on; a user turn
            # carrying the result (as Qwen's and Hermes' templates render it) reads naturally.
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        entry = {"role": role, "content": _parts(message, content) if parts else content}
        if calls:
            entry["tool_calls"] = calls
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
        instructions = _tool_instructions(request.tools, choice, tool_format)
        if messages[0]["role"] == "system" and not parts:
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}
        elif messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": [*messages[0]["content"], {"type": "text", "text": instructions}]}
        else:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": instructions}] if parts
                                else instructions})
    return messages


def _arguments(arguments, as_text: bool):
    if not as_text:
        return arguments_value(arguments)
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _parts(message, content: str) -> list[dict]:
    """A message's content as template parts: the request's own parts in order (an image part as
    `{"type": "image"}`, the placeholder the processor expands), else `content` as one text part.
    `content` is the message's text with anything appended (tool calls), which then follows its parts."""
    if not message.image_urls:
        return [{"type": "text", "text": content}]
    out = [{"type": "image"} if part["type"] == "image_url" else {"type": "text", "text": part["text"]}
           for part in message.content]
    extra = content[len(message.text):]  # what template_messages appended to the text
    return out + ([{"type": "text", "text": extra}] if extra else [])


def render_prompt(tokenizer, request: ChatCompletionRequest, *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, template_kwargs: dict | None = None,
                  tool_format: ToolFormat | None = None, vision=None, request_template: str | None = None) -> str:
    """The conversation as prompt text through the model's chat template. The keywords are vLLM's
    (its /tokenize takes them); a chat completion always opens the assistant's turn.
    `template_kwargs` defaults to the request's `chat_template_kwargs`; `tool_format` to the one
    the template implies. `vision` (a vision-language model's serving/vision.VisionInputs): its
    processor's template, content as parts, each image part its placeholder. `request_template`:
    the request's own `chat_template` (vllm.check_request_template allowed it), used instead, and
    named by the 400 when it fails."""
    if template_kwargs is None:
        template_kwargs = getattr(request, "chat_template_kwargs", None)
    template = request_template or (vision.chat_template if vision is not None
                                    else getattr(tokenizer, "chat_template", None))
    if not template:
        raise InvalidRequest("This model has no chat template; use /v1/completions", param="messages")
    knows_tools = isinstance(template, str) and "tools" in template
    renders_calls = isinstance(template, str) and "tool_calls" in template
    messages = template_messages(request, knows_tools, tool_format or tool_formats.detect(template), renders_calls,
                                 parts=vision is not None, string_arguments=joins_arguments(template))
    # The processor's or the request's template, not the tokenizer's.
    extra = {"chat_template": template} if vision is not None or request_template else {}
    if knows_tools and request.tools and request.effective_tool_choice != "none":
        # Whole OpenAI tool objects, the shape transformers' templates read (`tool.function`, ...).
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}), **extra)
    except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
        if request_template:
            raise InvalidRequest(f"The request's chat_template failed: {exc}", param="chat_template") from None
        raise InvalidRequest(f"The chat template rejected the messages: {exc}", param="messages") from None


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


def guided_decoding(request: ChatCompletionRequest, tool_format: ToolFormat | None = None,
                    marker_tokens: Mapping[str, int] = NO_TOKENS) -> GuidedDecoding | None:
    """The grammar the output must follow, or None for free text. Tool calls are written in
    `tool_format` (Hermes unless given), its markers as the model's own tokens where
    `marker_tokens` (the format's `marker_tokens(tokenizer)`) has them."""
    fmt = tool_format or tool_formats.DEFAULT
    constraint = response_constraint(request)
    choice = request.effective_tool_choice
    prefix, prefix_rules = fmt.answer_rules(marker_tokens)
    if constraint is not None and (not request.tools or choice == "none"):
        return _after(prefix, prefix_rules, constraint)
    if constraint is not None and constraint.json_schema is None:
        raise InvalidRequest("response_format: a regex cannot be combined with tools; use a JSON schema or "
                             "tool_choice none", param="response_format")
    schema = json.loads(constraint.json_schema) if constraint is not None else None
    if not request.tools:
        return None
    # Free text: anything after the format's answer opening, else text that cannot start a call.
    text = ["TEXT: /(.|\\n)*/"] if prefix else [text_rule(fmt.openers)]
    if choice == "none":  # tools are known to the conversation but must not be called
        return GuidedDecoding(lark="\n".join([f"start: {prefix + ' ' if prefix else ''}TEXT", *text, *prefix_rules])
                              + "\n")
    tools = request.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function["name"]]
    rules = fmt.calls_rules(tools, request.parallel_tool_calls and fmt.parallel, marker_tokens)
    if choice == "auto":
        if schema is not None:
            rules.insert(0, f"start: calls | {prefix + ' ' if prefix else ''}%json "
                            f"{json.dumps({**schema, 'x-guidance': _LAYOUT})}")
        else:
            rules.insert(0, f"start: calls | {prefix + ' ' if prefix else ''}TEXT")
            rules.extend(text)
        rules.extend(r for r in prefix_rules if r not in rules)
    else:
        rules.insert(0, "start: calls")
    return GuidedDecoding(lark="\n".join(rules) + "\n")


def _after(prefix: str, rules: list[str], constraint: GuidedDecoding | None) -> GuidedDecoding | None:
    """`constraint` (None: any text) written after the format's answer opening `prefix` (none: as it is)."""
    if not prefix:
        return constraint
    return GuidedDecoding(lark="\n".join([f"start: {prefix} answer", f"answer: {reasoning.as_lark(constraint)}",
                                          *rules]) + "\n")


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]
    complete: bool = True  # the calls are whole (else cut short: the last one's arguments end early)


def parse_tool_calls(text: str, tool_format: ToolFormat | None = None, *, partial: bool = False) -> ParsedOutput:
    """Split generated text into content and tool calls (`arguments` as the JSON the model wrote).
    Text that is not wholly calls in the format stays content, unless `partial`: then calls cut
    short (by max_tokens or a stop string) are read as a stream sends them, the calls written so
    far with the arguments as far as written (`complete` False); formats whose arguments do not
    stream (pythonic) leave such text content, as their streams do."""
    fmt = tool_format or tool_formats.DEFAULT
    scan = fmt.scan(text)
    complete = scan.complete and bool(scan.calls)
    if not scan.calls or not (complete or (partial and fmt.streams_arguments)):
        return ParsedOutput(text, [])
    return ParsedOutput(None, [{"id": fmt.new_call_id(), "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}} for call in scan.calls],
                        complete)
