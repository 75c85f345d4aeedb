"""Anthropic's stream events from the engine's, and a whole message as those events added up.

A stream is `message_start`, `ping`, then content blocks, each `content_block_start`, its deltas
and `content_block_stop`: a `thinking` block (`thinking_delta`s) while the model reasons, then
either a `text` block (`text_delta`s) or one `tool_use` block per call (`input_json_delta`s, the
arguments' JSON as the model writes it), and last `message_delta` (`stop_reason`, `stop_sequence`,
`usage.output_tokens`) and `message_stop`. With tools, the answer's first visible character decides
whether it is calls or text (the tool format's own test), as on the OpenAI routes; what was held
until then goes out with it. `whole_message` adds events up as Anthropic's clients do, so a whole
response is what the same request's stream adds up to.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from lmi_serve.dialects.openai.tool_formats import ToolFormat
from lmi_serve.dialects.openai.tool_stream import ToolCallStream
from lmi_serve.engine.types import FinishReason, TokenEvent


@dataclass(frozen=True)
class MessageMeta:
    id: str
    model: str
    input_tokens: int
    capped: bool = False  # max_tokens was more than the context left: a full context ends the message

    @classmethod
    def new(cls, model: str, input_tokens: int, capped: bool = False) -> MessageMeta:
        return cls(f"msg_{uuid.uuid4().hex}", model, input_tokens, capped)


def stop_reason(event: TokenEvent, calls_complete: bool, capped: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the message) for its last event."""
    if calls_complete:
        return "tool_use", None
    if event.finish_reason is FinishReason.LENGTH:  # the generation deadline's cut reads as the token limit's
        return ("model_context_window_exceeded" if capped and not event.deadline_cut else "max_tokens"), None
    if event.finish_reason is FinishReason.STOP_SEQUENCE:
        return "stop_sequence", event.stop_sequence
    return "end_turn", None


class MessageStream:
    """The events of one message, fed the engine's events split into (reasoning, answer) pieces.
    `tool_format`: the model's, when the answer may be tool calls (None: the answer is text);
    `show_thinking` False sends thinking blocks without their text (`display: omitted`)."""

    def __init__(self, meta: MessageMeta, tool_format: ToolFormat | None = None, show_thinking: bool = True):
        self.meta, self.tool_format, self.show_thinking = meta, tool_format, show_thinking
        self.calls = ToolCallStream(tool_format) if tool_format is not None else None
        self.answer = ""  # the answer's text so far
        self.output_tokens = 0
        self._calls_decided: bool | None = None  # with tools: is the answer calls (None: not yet known)
        self._blocks = 0
        self._open: str | None = None  # the type of the block being written

    def start(self) -> list[dict]:
        message = {"id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.meta.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, thought: str, answer: TokenEvent) -> list[dict]:
        """The events of one engine event: its reasoning text `thought`, and `answer`, the event with
        only its answer text; the last event also ends the message."""
        if answer.token_id >= 0:
            self.output_tokens += 1
        events = self._thinking(thought) if thought else []
        self.answer += answer.text
        events += self._answer(answer.text)
        if answer.finish_reason is not None:
            events += self._finish(answer)
        return events

    # ---- blocks ---------------------------------------------------------------------------------

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _start_block(self, block: dict) -> list[dict]:
        events = self._close()
        self._open, self._blocks = block["type"], self._blocks + 1
        return events + [{"type": "content_block_start", "index": self._blocks - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}

    def _thinking(self, piece: str) -> list[dict]:
        events = [] if self._open == "thinking" else self._start_block({"type": "thinking", "thinking": "",
                                                                        "signature": ""})
        return events + ([self._delta({"type": "thinking_delta", "thinking": piece})] if self.show_thinking else [])

    def _text(self, piece: str) -> list[dict]:
        if not piece:
            return []
        events = [] if self._open == "text" else self._start_block({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": piece})]

    def _tool_deltas(self, deltas: Iterable[dict]) -> list[dict]:
        """Calls in OpenAI's delta shape (tool_stream.py) as tool_use blocks and their input's JSON."""
        events = []
        for delta in deltas:
            if "id" in delta:  # a new call: calls come one after the other
                events += self._start_block({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                             "name": delta["function"]["name"], "input": {}})
            if delta["function"]["arguments"]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": delta["function"]["arguments"]}))
        return events

    # ---- the answer -----------------------------------------------------------------------------

    def _answer(self, piece: str) -> list[dict]:
        if self.tool_format is None or self._calls_decided is False:
            return self._text(piece)
        if self._calls_decided is None:
            if not self.answer.strip():
                return []  # held until the first visible character decides
            self._calls_decided = self.tool_format.is_call_start(self.answer)
            if not self._calls_decided:
                return self._text(self.answer)  # what was held goes out with it
        return self._tool_deltas(self.calls.deltas(self.answer))

    def _finish(self, last: TokenEvent) -> list[dict]:
        events, complete = [], False
        if self.tool_format is not None and self._calls_decided is not False:
            rest = self.calls.deltas(self.answer, final=True)
            if rest is not None:  # wholly calls: what is left of them
                events, complete = self._tool_deltas(rest), True
            elif not self.calls.started:  # never a call after all: the text is the answer
                events = self._text(self.answer)
            # else a call cut short: its fragments are out, and the message ends for that reason
        reason, sequence = stop_reason(last, complete, self.meta.capped)
        return events + self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": self.output_tokens}},
            {"type": "message_stop"}]


# ---- a whole message ------------------------------------------------------------------------------

def tool_input(text: str) -> dict:
    """A tool_use block's input from its JSON text. Complete calls parse as they are; a call cut
    short (max_tokens) keeps what its JSON holds so far, without the last unfinished string or
    value, as Anthropic's clients read a streamed input."""
    for end in range(len(text), 0, -1):
        closed = _closed(text[:end])
        if closed is None:
            continue
        try:
            value = json.loads(closed)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closed(prefix: str) -> str | None:
    """`prefix` with its open arrays and objects closed, or None where it cannot end (in a string,
    after a key or a comma)."""
    stack, in_string, escaped = [], False, False
    for char in prefix:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            stack.append("]" if char == "[" else "}")
        elif char in "]}" and stack:
            stack.pop()
    body = prefix.rstrip()
    if in_string or body.endswith((",", ":")):
        return None
    return body + "".join(reversed(stack))


def whole_message(events: Iterable[dict]) -> dict:
    """The message `events` add up to, as Anthropic's clients accumulate a stream."""
    message: dict = {}
    inputs: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            message = {**event["message"], "content": [], "usage": dict(event["message"]["usage"])}
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                inputs[event["index"]] = inputs.get(event["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
        elif kind == "content_block_stop" and event["index"] in inputs:
            message["content"][event["index"]]["input"] = tool_input(inputs.pop(event["index"]))
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"]["output_tokens"] = event["usage"]["output_tokens"]
    return message
