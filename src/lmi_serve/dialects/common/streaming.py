"""The one writer of streamed bodies: Server-Sent Events and JSON lines.

Every dialect that streams renders its chunks (dicts, or text it already framed as JSON) and
hands them here; only this module knows the framing: `data: <json>\\n\\n` per SSE event,
optionally ending with OpenAI's `data: [DONE]`, or named by the event's type (`event: <type>`, as
the Responses API and Anthropic frame their events), and one JSON document per line for JSON lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

SSE_MIMETYPE = "text/event-stream"
JSONLINES_MIMETYPE = "application/jsonlines"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer a stream
DONE = "[DONE]"


def dumps(value: Any, *, compact: bool = False) -> str:
    """JSON text of `value`, Unicode kept as is (`compact`: no spaces, for tensor payloads)."""
    if compact:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(value, ensure_ascii=False)


def sse_event(data: Any) -> str:
    """One SSE event carrying `data`: a dict or list is written as JSON, a str as given."""
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n"


def sse(chunks: Iterable[Any], *, done: bool = False) -> Iterator[str]:
    """Each chunk as one SSE event; `done` ends the stream with `data: [DONE]` (OpenAI's end)."""
    for chunk in chunks:
        yield sse_event(chunk)
    if done:
        yield sse_event(DONE)


def sse_named(events: Iterable[dict]) -> Iterator[str]:
    """Each event (a dict with a `type`) as one SSE event named by its type: `event: <type>` then its
    data, as OpenAI's Responses streams are framed (no `[DONE]`). Closed early (the client went
    away), it closes `events` at once, so what feeds them stops too."""
    try:
        for event in events:
            yield f"event: {event['type']}\n{sse_event(event)}"
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def json_line(data: Any) -> str:
    """One JSON-lines record: a dict or list as JSON, a str as given (already JSON text)."""
    return f"{data if isinstance(data, str) else dumps(data)}\n"


def jsonlines(chunks: Iterable[Any]) -> Iterator[str]:
    for chunk in chunks:
        yield json_line(chunk)
