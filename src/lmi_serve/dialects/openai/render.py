"""OpenAI response bodies and stream chunks, as functions of the request and the output so far.

Chat logprobs use `content: [{token, logprob, bytes, top_logprobs}]` (exactly `top_logprobs`
alternatives); completions logprobs the four parallel arrays (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), where `top_logprobs` also holds the chosen token (OpenAI's
"up to logprobs + 1") and is null for the first echoed prompt token. Finish reasons are
OpenAI's: `stop` (EOS, a stop string, a finished grammar), `length`, `tool_calls`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmi_serve.dialects.openai.chat import parse_tool_calls
from lmi_serve.dialects.openai.generation import ChoiceState
from lmi_serve.dialects.openai.tool_formats import DEFAULT as DEFAULT_TOOL_FORMAT
from lmi_serve.dialects.openai.tool_formats import ToolFormat
from lmi_serve.dialects.openai.tool_stream import ToolCallStream
from lmi_serve.engine.types import FinishReason, TokenEvent, TopToken

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseMeta":
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---- chat ---------------------------------------------------------------------------------------

def _chat_token(token_id: int, text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(events: Sequence[TokenEvent], top: int, token_text: TokenText) -> dict:
    content = []
    for event in events:
        if event.token_id < 0:
            continue
        entry = _chat_token(event.token_id, token_text(event.token_id), event.logprob)
        entry["top_logprobs"] = [_chat_token(t.token_id, t.text, t.logprob) for t in event.top_tokens[:top]]
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_message(state: ChoiceState, tools_enabled: bool,
                 tool_format: ToolFormat = DEFAULT_TOOL_FORMAT) -> tuple[dict, str | None]:
    """(message, finish reason) of one finished choice. Calls cut short (max_tokens) come back as
    OpenAI returns them and as the stream sent them: `tool_calls` with the arguments written so
    far, finishing for that reason (`length`)."""
    text = state.text
    reason = finish_reason(state.events[-1].finish_reason)
    if tools_enabled:
        parsed = parse_tool_calls(text, tool_format, partial=True)
        if parsed.tool_calls:
            return ({"role": "assistant", "content": None, "tool_calls": parsed.tool_calls},
                    "tool_calls" if parsed.complete else reason)
    return {"role": "assistant", "content": text}, reason


def chat_completion(meta: ResponseMeta, states: Sequence[ChoiceState], *, logprobs: bool, top_logprobs: int,
                    tools_enabled: bool, token_text: TokenText,
                    tool_format: ToolFormat = DEFAULT_TOOL_FORMAT) -> dict:
    choices = []
    for state in states:
        message, reason = chat_message(state, tools_enabled, tool_format)
        choices.append({"index": state.index, "message": message, "finish_reason": reason,
                        "logprobs": chat_logprobs(state.events, top_logprobs, token_text) if logprobs else None})
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": usage(states[0].prompt_tokens, sum(s.generated for s in states))}


class ChatStream:
    """Chunks of one chat stream. Per choice: a role chunk with the first token, content deltas
    (each carrying the logprobs of its own tokens), one finish chunk with an empty delta. When the
    output may be a tool call, text that starts like a call in `tool_format` is held back from
    content and goes out as `tool_calls` deltas (tool_stream.py); any other text streams as content."""

    def __init__(self, meta: ResponseMeta, *, include_usage: bool, logprobs: bool, top_logprobs: int,
                 tools_enabled: bool, token_text: TokenText, tool_format: ToolFormat = DEFAULT_TOOL_FORMAT):
        self.meta, self.include_usage = meta, include_usage
        self.logprobs, self.top_logprobs = logprobs, top_logprobs
        self.tools_enabled, self.token_text = tools_enabled, token_text
        self.tool_format = tool_format
        self._started: set[int] = set()
        self._holding: dict[int, bool] = {}  # choice -> output is (so far) a tool call
        self._calls: dict[int, ToolCallStream] = {}
        self._unsent: dict[int, list[TokenEvent]] = {}  # held events whose logprobs have not gone out

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
                 "model": self.meta.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, delta: dict, reason: str | None = None, events=()) -> dict:
        logprobs = chat_logprobs(events, self.top_logprobs, self.token_text) if self.logprobs and events else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def start(self, index: int) -> list[dict]:
        """The role chunk of choice `index`, once. Sent before its first token is added to the
        choice, so running usage (continuous_usage_stats) does not count that token yet."""
        if index in self._started:
            return []
        self._started.add(index)
        return [self._chunk([self._choice(index, {"role": "assistant", "content": ""})])]

    def on_event(self, state: ChoiceState, event: TokenEvent) -> list[dict]:
        """Chunks for `event`, the latest of `state.events`."""
        index = state.index
        chunks = self.start(index)
        text, events = event.text, [event]
        if self.tools_enabled and index not in self._holding and state.text.strip():
            # Decided by the first visible character; what was held until now goes out with it.
            self._holding[index] = self.tool_format.is_call_start(state.text)
            text, events = state.text, state.events
            if not self._holding[index]:
                self._unsent.pop(index, None)  # they go out with this content chunk
        holding = self._holding.get(index, self.tools_enabled)
        if not holding and (text or (self.logprobs and event.token_id >= 0)):
            chunks.append(self._chunk([self._choice(index, {"content": text}, events=events)]))
        if holding:
            unsent = self._unsent.setdefault(index, [])
            unsent.append(event)
            calls = self._calls.setdefault(index, ToolCallStream(self.tool_format))
            deltas = calls.deltas(state.text) if self._holding.get(index) else []
            if deltas:
                chunks.append(self._chunk([self._choice(index, {"tool_calls": deltas}, events=list(unsent))]))
                unsent.clear()
        if event.finish_reason is not None:
            chunks.extend(self._finish(state, holding))
        return chunks

    def _finish(self, state: ChoiceState, holding: bool) -> list[dict]:
        index, chunks = state.index, []
        reason = finish_reason(state.events[-1].finish_reason)
        unsent = self._unsent.pop(index, [])
        if holding:
            calls = self._calls.setdefault(index, ToolCallStream(self.tool_format))
            deltas = calls.deltas(state.text, final=True)
            if deltas is not None:  # wholly calls: what is left of them, then finish as tool_calls
                reason = "tool_calls"
                if deltas:
                    chunks.append(self._chunk([self._choice(index, {"tool_calls": deltas}, events=unsent)]))
                    unsent = []
            elif not calls.started and state.text:  # never a call after all: the text is content
                chunks.append(self._chunk([self._choice(index, {"content": state.text}, events=unsent)]))
                unsent = []
            # else a call cut short (max_tokens): its fragments are out; it ends with that reason
        chunks.append(self._chunk([self._choice(index, {}, reason, events=unsent)]))
        return chunks

    def usage_chunk(self, states: Sequence[ChoiceState]) -> dict:
        return {**self._chunk([]), "usage": usage(states[0].prompt_tokens, sum(s.generated for s in states))}


# ---- completions --------------------------------------------------------------------------------

@dataclass
class CompletionChoice:
    """One completions choice: its engine output plus what echo/suffix/logprobs need of its prompt."""

    state: ChoiceState
    prompt_text: str
    echo: bool
    suffix: str | None


def completion_logprobs(choice: CompletionChoice, events: Sequence[TokenEvent], top: int, token_text: TokenText,
                        offset: int, with_prompt: bool) -> dict:
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    prompt: tuple[TopToken, ...] = (events[0].prompt_tokens or ()) if with_prompt and events else ()
    for token in prompt:
        tokens.append(token.text)
        values.append(token.logprob)
        # The engine scores prompt tokens without alternatives; the first has no context at all.
        tops.append(None if token.logprob is None else {token.text: token.logprob})
    for event in events:
        if event.token_id < 0:
            continue
        text = token_text(event.token_id)
        tokens.append(text)
        values.append(event.logprob)
        tops.append(_top_with_chosen(event, text, top))
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_with_chosen(event: TokenEvent, text: str, top: int) -> dict[str, float]:
    """The `top` best alternatives plus the chosen token (OpenAI: up to logprobs + 1 entries), so
    `logprobs: 0` still names the token and a sampled token outside the top-N appears too."""
    alternatives = {t.text: t.logprob for t in event.top_tokens[:top]}
    alternatives.setdefault(text, event.logprob)
    return alternatives


def completion_text(choice: CompletionChoice) -> str:
    text = (choice.prompt_text if choice.echo else "") + choice.state.text
    if choice.suffix and choice.state.finished:
        text += choice.suffix
    return text


def completion(meta: ResponseMeta, choices: Sequence[CompletionChoice], *, logprobs: int | None,
               token_text: TokenText, prompt_tokens: int) -> dict:
    body_choices = []
    for choice in choices:
        state = choice.state
        body_choices.append({
            "index": state.index, "text": completion_text(choice),
            "finish_reason": finish_reason(state.events[-1].finish_reason),
            "logprobs": completion_logprobs(choice, state.events, logprobs, token_text, 0, choice.echo)
            if logprobs is not None else None,
        })
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": body_choices, "usage": usage(prompt_tokens, sum(c.state.generated for c in choices))}


def completion_chunk(meta: ResponseMeta, choice: CompletionChoice, event: TokenEvent, *, first: bool,
                     logprobs: int | None, token_text: TokenText, include_usage: bool) -> dict | None:
    """The chunk for one event of one choice: echo goes with the first, the suffix with the last."""
    text = (choice.prompt_text if choice.echo and first else "") + event.text
    if event.finish_reason is not None and choice.suffix:
        text += choice.suffix
    if not text and event.finish_reason is None and logprobs is None:
        return None
    offset = len(completion_text(choice)) - len(text) if not first else 0
    body = {"index": choice.state.index, "text": text, "finish_reason": finish_reason(event.finish_reason),
            "logprobs": completion_logprobs(choice, [event], logprobs, token_text, offset, choice.echo and first)
            if logprobs is not None else None}
    chunk = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
             "choices": [body]}
    if include_usage:
        chunk["usage"] = None
    return chunk
