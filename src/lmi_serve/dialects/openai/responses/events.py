"""The Responses event stream of one chat stream (openai.types.responses' stream events).

`response.created`, `response.in_progress`; then per output item `response.output_item.added`, its
deltas and `response.output_item.done`: a reasoning item with one `reasoning_text` part
(`response.content_part.added`, `response.reasoning_text.delta` ..., `.done`,
`response.content_part.done`), a message with one `output_text` part (`response.output_text.delta` ...),
function calls (`response.function_call_arguments.delta` ..., `.done`); last `response.completed` (or
`response.incomplete` at the token limit) carrying the whole Response, built by output.py as a
non-streamed one is, from the same items. Every event has its `sequence_number`, from 0. A failure after
the stream began is an `error` event and then `response.failed`.

The chat chunks are read one at a time; an item ends when the next one begins or the answer finishes,
so every delta belongs to the one open item.
"""

from __future__ import annotations

from collections.abc import Iterator

from lmi_serve.dialects.openai.responses import output
from lmi_serve.dialects.openai.responses.output import ResponseShell, new_id

Event = dict
# An error object's code -> the code `response.failed` carries (one of ResponseError's); else server_error.
_FAILED_CODES = {"rate_limit_exceeded": "rate_limit_exceeded"}


class _OpenItem:
    """The item being written: its index, kind, id and what it holds so far."""

    def __init__(self, index: int, kind: str, item_id: str, call_id: str = "", name: str = ""):
        self.index, self.kind, self.id = index, kind, item_id
        self.call_id, self.name, self.text = call_id, name, ""

    def item(self, status: str, whole: bool = True) -> dict:
        text = self.text if whole else None
        if self.kind == "reasoning":
            return output.reasoning_item(self.id, text, status)
        if self.kind == "message":
            return output.message_item(self.id, text, status)
        return output.function_call_item(self.id, self.call_id, self.name, self.text if whole else "", status)


class ResponseEvents:
    """Events of one response, fed the chat stream's chunks in order."""

    def __init__(self, shell: ResponseShell):
        self.shell = shell
        self.items: list[dict] = []  # finished items
        self.status: str | None = None  # completed, incomplete or failed, once the response ends
        self._open: _OpenItem | None = None
        self._calls = False  # the answer holds function calls
        self._usage: dict | None = None
        self._sequence = 0
        self.final: dict | None = None  # the finished Response, once `closing` built it

    def _event(self, kind: str, **fields) -> Event:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def opening(self) -> list[Event]:
        body = self.shell.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    # ---- items --------------------------------------------------------------------------------

    def _begin(self, kind: str, item_id: str, **call) -> list[Event]:
        events = self._end("completed")
        self._open = _OpenItem(len(self.items), kind, item_id, **call)
        events.append(self._event("response.output_item.added", output_index=self._open.index,
                                  item=self._open.item("in_progress", whole=False)))
        part = {"reasoning": output.reasoning_part(""), "message": output.output_text_part("")}.get(kind)
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item_id,
                                      output_index=self._open.index, content_index=0, part=part))
        return events

    def _delta(self, text: str) -> list[Event]:
        item = self._open
        item.text += text
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            return [self._event("response.function_call_arguments.delta", **where, delta=text)]
        if item.kind == "reasoning":
            return [self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        return [self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]

    def _end(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        elif item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=output.reasoning_part(item.text))]
        else:
            events = [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=output.output_text_part(item.text))]
        done = item.item(status)
        self.items.append(done)
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open.kind == kind else \
            self._begin(kind, new_id("rs" if kind == "reasoning" else "msg"))
        return events + self._delta(text)

    def _tool_call(self, delta: dict) -> list[Event]:
        events = []
        function = delta.get("function") or {}
        if "id" in delta:  # a call's first delta: its id and name
            self._calls = True
            events += self._begin("function_call", new_id("fc"), call_id=delta["id"], name=function.get("name", ""))
        if function.get("arguments"):
            events += self._delta(function["arguments"])
        return events

    # ---- chunks -------------------------------------------------------------------------------

    def on_chunk(self, chunk: dict) -> list[Event]:
        """The events of one chat chunk (a delta, the finish, the usage, or an error object)."""
        if "error" in chunk:
            return self._failed(chunk["error"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                events += self._finish(choice["finish_reason"] == "length")
        return events

    def _finish(self, cut_short: bool) -> list[Event]:
        """The answer ended: an answer without calls always has its message (as a whole response does)."""
        events = []
        if not self._calls and (self._open is None or self._open.kind != "message"):
            events += self._begin("message", new_id("msg"))
        events += self._end("incomplete" if cut_short else "completed")
        self.status = "incomplete" if cut_short else "completed"
        return events

    def closing(self) -> list[Event]:
        """The last events, once the chat stream has ended: the whole Response (`final`)."""
        events = self._finish(cut_short=True) if self.status is None else []  # ended without a finish: cut off
        self.final = self.shell.body(self.status, list(self.items), self._usage)
        return events + [self._event(f"response.{self.status}", response=self.final)]

    def _failed(self, error: dict) -> list[Event]:
        self.status = "failed"
        code = _FAILED_CODES.get(error.get("code"), "server_error")
        failed = self.shell.body("failed", list(self.items), self._usage,
                                 error={"code": code, "message": error.get("message", "")})
        return [self._event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param")),
                self._event("response.failed", response=failed)]


def events(shell: ResponseShell, chunks: Iterator[dict], on_done=None) -> Iterator[Event]:
    """The whole event stream of `chunks` (a chat stream with its usage chunk). `on_done(response)` is
    called with the finished Response before its last event goes out (so it is stored by then).
    Closing this stream closes `chunks` (which cancels the generation)."""
    state = ResponseEvents(shell)
    try:
        yield from state.opening()
        for chunk in chunks:
            yield from state.on_chunk(chunk)
            if state.status == "failed":
                return
        tail = state.closing()
        if on_done is not None:
            on_done(state.final)
        yield from tail
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
