"""Stored responses: the last `option.responses_store_size` responses of a model, in this worker's memory.

A stored response keeps its Response object (what `GET /v1/responses/<id>` returns) and the
conversation it answered (its input items after those of the response it followed), so a request
naming it as `previous_response_id` continues that conversation. The oldest is dropped when the
store is full. Nothing survives a restart, and each gunicorn worker has its own store: a follow-up
that reaches another worker finds no such id and is a 404 naming it, never an answer as if the
earlier turn had not happened (docs/openai.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from lmi_serve.errors import NotFound


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as it was answered
    input_items: list[dict]  # the conversation's items before its output (earlier turns included)

    @property
    def history(self) -> list[dict]:
        """The items a follow-up continues from: the input, then this response's output."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    """A bounded, thread-safe map of response id -> Stored (the request threads of one worker share it)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._entries[stored.response["id"]] = stored
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


def missing(response_id: str, param: str | None = None) -> NotFound:
    """The 404 for an id no store of this worker holds, saying why that may be."""
    shown = response_id[:256]
    return NotFound(f"No stored response with id '{shown}' on this server: it was not stored (store: false, or "
                    "option.responses_store_size=0), has been dropped (the store keeps the last responses only), "
                    "was stored before a restart, or by another worker process", param=param,
                    code="response_not_found")


def find(stores: Iterable[ResponseStore], response_id: str, param: str | None = None) -> tuple[ResponseStore, Stored]:
    """The store holding `response_id` and what it holds; a 404 naming the id when none does."""
    for store in stores:
        stored = store.get(response_id)
        if stored is not None:
            return store, stored
    raise missing(response_id, param)
