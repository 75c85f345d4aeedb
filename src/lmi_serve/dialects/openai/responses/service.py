"""One Responses request over the chat service: the conversation (with a stored earlier turn), the
chat request, and the chat answer rendered as a Response or its event stream, stored when asked.

The chat service does the work: prompt, grammar (tools, text.format), reasoning split, engine and
disconnects (a whole response waits watching the client's socket; closing a stream closes the chat
stream, which cancels the generation within a step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from lmi_serve.dialects.common import reasoning
from lmi_serve.dialects.openai.responses import convert, items
from lmi_serve.dialects.openai.responses.events import Event, events
from lmi_serve.dialects.openai.responses.output import ResponseShell, from_chat
from lmi_serve.dialects.openai.responses.request import ResponsesRequest
from lmi_serve.dialects.openai.responses.store import ResponseStore, Stored, find
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.errors import InvalidRequest


class ResponsesService:
    def __init__(self, chat: OpenAIService, store: ResponseStore, stores: Callable[[], Iterable[ResponseStore]]):
        """`chat`: the model's chat service; `store`: where its responses are kept; `stores`: every
        model's store in this worker (a previous response may be another model's)."""
        self.chat, self.store, self.stores = chat, store, stores

    def _template(self):
        vision = self.chat.vision
        return vision.chat_template if vision is not None else getattr(self.chat.tokenizer, "chat_template", None)

    def _reasons(self) -> bool:
        parser = self.chat.reasoning.parser if self.chat.reasoning is not None else "auto"
        return reasoning.markers(self.chat.tokenizer, parser) is not None

    def _history(self, request: ResponsesRequest) -> list[dict]:
        if request.previous_response_id is None:
            return []
        return find(self.stores(), request.previous_response_id, "previous_response_id")[1].history

    def create(self, request: ResponsesRequest) -> dict | Iterator[Event]:
        """The Response object, or (`stream`) its events; a refusal before generation raises its kind."""
        if request.store is True and self.store.size <= 0:
            raise InvalidRequest("store: responses are not kept for this model (option.responses_store_size=0); "
                                 "send store: false or leave it out", param="store")
        history = self._history(request)
        own = items.as_items(request.input)
        conversation = items.conversation(request.instructions, history, own)
        chat_request = convert.chat_request(request, conversation, self._template(), self._reasons())
        shell = ResponseShell(request, self.chat.model_name)
        with convert.responses_names(conversation):
            reply = self.chat.chat(chat_request)

        def keep(response: dict) -> None:
            if request.stores:
                self.store.put(Stored(response, [*history, *own]))

        if reply.chunks is None:
            response = from_chat(shell, reply.body)
            keep(response)
            return response
        return events(shell, reply.chunks, on_done=keep)
