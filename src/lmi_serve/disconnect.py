"""Cancel a whole (non-streamed) generation when its client goes away.

A streamed response notices a gone client when a write fails: the WSGI server closes the chunk
generator, and closing it cancels the engine request. A whole response writes nothing until the
generation ends, so the request thread watches the connection while it waits instead:
`wait_for_events(handles)` (or `wait_for_results`) gathers every handle's events, checks the client's socket each time it
wakes (an event arrived, or `POLL_SECONDS` passed), and if the client closed its connection it
cancels all the handles (the engine drops them at its next step) and raises ClientGone.
Every dialect's non-streaming route waits through it.

The connection is gunicorn's `gunicorn.socket` in the WSGI environ. The check peeks without
blocking and consumes nothing: an empty read is the peer's FIN (EOF), a reset is a reset; bytes
waiting are a pipelined request (the request body itself was read before generation began), so
the client is still there. A client that sent a request and then closed its side while it still
waits for the answer (a half-close) counts as gone, as in most HTTP servers. Without a plain
socket (Flask's test client, a TLS socket) nothing is watched and waiting is plain waiting.
"""

from __future__ import annotations

import socket
import ssl

from flask import has_request_context, request

from .engine.handle import RequestHandle
from .engine.types import GenerationResult, TokenEvent
from .errors import ClientGone

# How long the request thread waits for an event before it looks at the socket again. A running
# request gets an event every engine step, so the check runs at least once per step; this bounds
# it for a request still waiting for a row (or in a long prefill).
POLL_SECONDS = 0.05


class ClientConnection:
    """A request's client socket, looked at without consuming anything from it."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def current(cls) -> ClientConnection | None:
        """The connection of the request this thread serves; None outside a request, or without a
        plain socket to watch (Flask's test client; a TLS socket cannot be peeked)."""
        if not has_request_context():
            return None
        sock = request.environ.get("gunicorn.socket")
        if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
            return None
        return cls(sock)

    def closed(self) -> bool:
        """Whether the client closed (or reset) the connection."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: still connected
        except ConnectionError:
            return True  # reset (or already shut down)
        except OSError:
            return False  # not a connection state we can tell: keep waiting, as without a socket


def wait_for_events(handles: list[RequestHandle],
                    connection: ClientConnection | None = None) -> list[list[TokenEvent]]:
    """Every handle's events up to its last, index-aligned; one handle's failure (e.g.
    Timeout) raises. `connection` defaults to the current request's. Whatever happens (all
    finished, a failure, a gone client), every handle is cancelled on the way out: a no-op for the
    finished ones, and the engine drops the rest at its next step."""
    if connection is None:
        connection = ClientConnection.current()
    try:
        return [_events(handle, connection) for handle in handles]
    finally:
        for handle in handles:
            handle.cancel()


def wait_for_results(handles: list[RequestHandle],
                     connection: ClientConnection | None = None) -> list[GenerationResult]:
    """`wait_for_events` as one GenerationResult per handle."""
    return [GenerationResult(len(handle.request.prompt_ids), events)
            for handle, events in zip(handles, wait_for_events(handles, connection))]


def _events(handle: RequestHandle, connection: ClientConnection | None) -> list[TokenEvent]:
    if connection is None:
        return list(handle)
    events: list[TokenEvent] = []
    while True:
        event = handle.next_event(POLL_SECONDS)
        if event is not None:
            events.append(event)
            if event.finish_reason is not None:
                return events
        if connection.closed():
            raise ClientGone("The client closed the connection before the response was complete")
