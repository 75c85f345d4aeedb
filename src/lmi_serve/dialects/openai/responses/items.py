"""Responses input items -> chat messages, each remembered with where it came from.

Items honoured: messages (`{role, content}` with or without `type: message`; content a string or
`input_text` / `output_text` / `refusal` parts, and `input_image` parts for a vision-language model),
`function_call` (an assistant turn's tool call), `function_call_output` (a tool message), and
`reasoning` (its text goes with the next assistant turn as `reasoning_content`, which templates such
as Qwen3's read). Output items of an earlier response are valid input as they are, so a client can
send `previous.output` back. Any other item type (built-in tool calls, item references, files) is a
400 naming the item: it would change the answer and cannot be honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmi_serve.dialects.common.validation import field_problems
from lmi_serve.errors import InvalidRequest

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


class _Item(BaseModel):
    # Output items carry ids, statuses, annotations and logprobs that change nothing here.
    model_config = ConfigDict(extra="allow")


class ImagePart(_Item):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


_ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


@dataclass
class Conversation:
    """Chat messages (ChatMessage dicts) and, per message, the request field it came from."""

    messages: list[dict] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, message: dict, origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)


def as_items(value: str | list[dict]) -> list[dict]:
    """`input` as a list of items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def parse_item(raw: Any, where: str) -> _Item:
    """One item as its model; a 400 naming `where` (e.g. `input.2`) for what is wrong with it."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where}: an item must be an object", param=where)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in _ITEMS:
        raise InvalidRequest(f"{where}.type: items of type {str(kind)[:64]!r} are not supported; input items are "
                             "messages, function_call, function_call_output and reasoning", param=f"{where}.type")
    try:
        item = _ITEMS[kind].model_validate(raw)
    except ValidationError as exc:
        problem = field_problems(exc)[0]
        param = problem.where(where)
        raise InvalidRequest(f"{param}: {problem.message}", param=param) from None
    if isinstance(item, ReasoningItem) and item.encrypted_content:
        raise InvalidRequest(f"{where}.encrypted_content: encrypted reasoning cannot be read here (this server never "
                             "writes it); send the reasoning as content, or leave the item out",
                             param=f"{where}.encrypted_content")
    return item


def _text(part: dict, where: str) -> str:
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind)
    if key is None or not isinstance(part.get(key), str):
        raise InvalidRequest(f"{where}: content parts of type {str(kind)[:64]!r} are not supported here; parts are "
                             "input_text, output_text, refusal, and input_image in a user message", param=where)
    return part[key]


def _image(part: dict, where: str) -> dict:
    try:
        image = ImagePart.model_validate(part)
    except ValidationError as exc:
        problem = field_problems(exc)[0]
        raise InvalidRequest(f"{problem.where(where)}: {problem.message}", param=problem.where(where)) from None
    if image.file_id is not None or image.image_url is None:
        raise InvalidRequest(f"{where}: an input_image needs an image_url (uploaded files are not served)",
                             param=f"{where}.file_id")
    if image.detail not in (None, "auto"):
        raise InvalidRequest(f"{where}.detail: {image.detail!r} cannot be honoured: this model's processor sets "
                             "the image's resolution; send 'auto'", param=f"{where}.detail")
    return {"type": "image_url", "image_url": {"url": image.image_url}}


def _content(content: str | list[dict], where: str) -> str | list[dict]:
    """Message content as chat content: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        here = f"{where}.content.{j}"
        if part.get("type") == "input_image":
            parts.append(_image(part, here))
        else:
            parts.append({"type": "text", "text": _text(part, here)})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # one string: templates without part support read it
    return parts


def _reasoning_text(item: ReasoningItem, where: str) -> str:
    """The reasoning's own text, else its summary's (what OpenAI's models return instead)."""
    parts = item.content if item.content else item.summary
    return "".join(_text({**p, "type": "output_text"}, f"{where}.content") for p in parts)


class _Builder:
    """Items in order -> a Conversation; reasoning waits for the assistant turn it belongs to."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        self.reasoning: tuple[str, str] | None = None  # (text, where) not yet placed

    def _assistant(self, message: dict, where: str) -> None:
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning[0]
            self.reasoning = None
        self.conversation.add(message, where)

    def add(self, item: _Item, where: str) -> None:
        messages = self.conversation.messages
        if isinstance(item, ReasoningItem):
            self.reasoning = (_reasoning_text(item, where), where)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            self._assistant({"role": "assistant", "content": _content(item.content, where)}, where)
        elif isinstance(item, MessageItem):
            self._no_reasoning_pending()
            self.conversation.add({"role": item.role, "content": _content(item.content, where)}, where)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and self.reasoning is None:
                messages[-1].setdefault("tool_calls", []).append(call)  # the same turn's next call
            else:
                self._assistant({"role": "assistant", "content": None, "tool_calls": [call]}, where)
        else:
            self._no_reasoning_pending()
            output = item.output if isinstance(item.output, str) else _content(item.output, where + ".output")
            if not isinstance(output, str):
                raise InvalidRequest(f"{where}.output: a function call's output may hold text only",
                                     param=f"{where}.output")
            self.conversation.add({"role": "tool", "tool_call_id": item.call_id, "content": output}, where)

    def _no_reasoning_pending(self) -> None:
        if self.reasoning is not None:
            where = self.reasoning[1]
            raise InvalidRequest(f"{where}: a reasoning item must come right before the assistant message or "
                                 "function call it led to", param=where)

    def finish(self) -> Conversation:
        self._no_reasoning_pending()
        return self.conversation


def conversation(instructions: str | None, history: list[dict], items: list[dict]) -> Conversation:
    """The chat messages of a request: its `instructions` as the system message, then the stored
    `history` of the response it follows (previous_response_id; earlier instructions are not carried
    over, as OpenAI does), then its own `items` (`input`)."""
    built = Conversation()
    if instructions:
        built.add({"role": "system", "content": instructions}, "instructions")
    builder = _Builder(built)
    for raw in history:
        builder.add(parse_item(raw, "previous_response_id"), "previous_response_id")
    for i, raw in enumerate(items):
        builder.add(parse_item(raw, f"input.{i}"), f"input.{i}")
    if not built.messages:
        raise InvalidRequest("input: there is nothing to answer; send at least one message", param="input")
    return builder.finish()
