"""One Messages request on the chat service: checked, prepared, generated, rendered.

The chat service (openai/service.py) prepares the prompt, the grammar (tools, JSON output) and the
reasoning split as for a chat completion; this module adds Anthropic's rules (thinking only where
the model thinks; max_tokens capped at the context left, which then ends the message as
`model_context_window_exceeded`) and renders events. A stream awaits its first event before the
status line, so a failure before generation still gets its status; a later one ends the stream
with an `error` event; a client gone (its socket looked at every step, or a write that fails) ends
the stream, which cancels generation. A whole message waits watching the client's socket, and is
what its stream would add up to.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from lmi_serve.dialects.anthropic.convert import chat_request
from lmi_serve.dialects.anthropic.errors import kind_body
from lmi_serve.dialects.anthropic.render import MessageMeta, MessageStream, whole_message
from lmi_serve.dialects.anthropic.schema import CountTokensRequest, ImageBlock, MessagesRequest
from lmi_serve.dialects.common import guided, reasoning
from lmi_serve.dialects.common.disconnect import ClientConnection, wait_for_results
from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.dialects.openai.service import OpenAIService, PreparedChat
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import TokenEvent
from lmi_serve.errors import InvalidRequest, ServingError


@dataclass
class Reply:
    """A whole message, or the events of its stream."""

    body: dict | None = None
    events: Iterator[dict] | None = None


class MessagesService:
    def __init__(self, chat: OpenAIService):
        self.chat = chat

    def count_tokens(self, request: CountTokensRequest) -> dict:
        """The prompt's tokens, as /v1/messages would read it (images as the model sees them)."""
        self._check(request)
        _, ids, _ = self.chat.chat_prompt(chat_request(request))
        return {"input_tokens": len(ids)}

    def create(self, request: MessagesRequest) -> Reply:
        self._check(request)
        job = self.chat.prepare_chat(chat_request(request), over="cap")
        generation = guided.generate(self.engine, job.requests, _grammar_fields(request))
        meta = MessageMeta.new(self.chat.model_name, len(job.prompt), capped=job.max_new_tokens < request.max_tokens)
        show = request.thinking is None or request.thinking.display != "omitted"
        stream = MessageStream(meta, self.chat.tool_format if job.tools_enabled else None, show_thinking=show)
        if not request.stream:
            (result,) = wait_for_results(generation)  # cancelled if the client goes away
            if result.error:
                result.events[-1].raise_failure()
            return Reply(body=whole_message(_events(stream, job, result.events)))
        generation.start()  # a failure before the first token raises here, before any status line
        engine_events = _while_connected(_engine_events(generation), ClientConnection.current())
        return Reply(events=_guarded(_events(stream, job, engine_events), generation))

    @property
    def engine(self):
        return self.chat.engine

    def _check(self, request: CountTokensRequest) -> None:
        """What the model must be able to do for `request`: see images, think within a budget."""
        if self.chat.vision is None:
            for m, message in enumerate(request.messages):
                for b, block in enumerate(message.blocks):
                    if isinstance(block, ImageBlock):
                        where = f"messages.{m}.content.{b}"
                        raise InvalidRequest(f"{where}: the model `{self.chat.model_name}` takes text only; image "
                                             "blocks need a vision-language model", param=where)
        thinking = request.thinking
        if thinking is None or thinking.type != "enabled":
            return
        settings = self.chat.reasoning or ReasoningSettings()
        markers = reasoning.markers(self.chat.tokenizer, settings.parser)
        if markers is None:
            raise InvalidRequest(f"thinking: the model `{self.chat.model_name}` does not think (it has no reasoning "
                                 "parser: option.reasoning_parser); leave thinking out, or disable it",
                                 param="thinking")
        if not markers.tokens:
            raise InvalidRequest("thinking.budget_tokens: this model writes its reasoning markers as plain text, so "
                                 "no token budget can bound its thinking; use thinking of type 'adaptive'",
                                 param="thinking.budget_tokens")


def _grammar_fields(request: MessagesRequest) -> str:
    """The fields a grammar the compiler refuses came from: a tool's input_schema, the output format."""
    fields = (["tools"] if request.tools else []) + (
        ["output_config.format"] if request.output_config is not None and request.output_config.format else [])
    return " or ".join(fields) or "messages"


def _engine_events(generation: Generation) -> Iterator[TokenEvent]:
    """The one sequence's events as the engine sends them; a failure raises its kind."""
    for _, event in generation.events():
        if event.error:
            event.raise_failure()
        yield event


def _while_connected(events: Iterator[TokenEvent], connection: ClientConnection | None) -> Iterator[TokenEvent]:
    """`events` until the client goes away. A stream notices that when a write fails, but some steps
    write nothing (thinking with `display: omitted`, an answer held until it shows whether it is a
    tool call), so the socket is looked at (a peek, nothing read) at every step."""
    for event in events:
        if connection is not None and connection.closed():
            return  # the stream ends, which cancels the generation
        yield event


def _events(stream: MessageStream, job: PreparedChat, events) -> Iterator[dict]:
    """Anthropic's events for the engine's `events`, each split into reasoning and answer."""
    yield from stream.start()
    for event in events:
        thought, answer = job.thinking.split_event(0, event)
        yield from stream.feed(thought, answer)


def _guarded(events: Iterator[dict], generation: Generation) -> Iterator[dict]:
    """A failure after the status line ends the stream with an `error` event; closing the stream
    (the client gone) cancels generation."""
    try:
        yield from events
    except ServingError as exc:
        yield kind_body(exc)
    finally:
        generation.close()
