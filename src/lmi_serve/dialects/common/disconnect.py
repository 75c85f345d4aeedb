"""Cancel a whole (non-streamed) generation when its client goes away.

A streamed response notices a gone client when a write fails: the WSGI server closes the chunk
generator, and closing it cancels the engine request. A whole response writes nothing until the
generation ends, so the request thread watches the connection while it waits instead:
`wait_for_results(generation)` gathers every sequence's events and checks the client's socket each
time it wakes (an event arrived, or the Generation's poll interval passed); if the client closed
its connection, the Generation is cancelled (the engine drops it at its next step) and ClientGone
is raised. Every dialect's non-streaming route waits through it.

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

from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import GenerationResult


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


def wait_for_results(generation: Generation,
                     connection: ClientConnection | None = None) -> list[GenerationResult]:
    """`generation.results`, watching `connection` (default: the current request's) for a client
    that goes away: then every sequence is cancelled and ClientGone raised."""
    if connection is None:
        connection = ClientConnection.current()
    return generation.results(connection.closed if connection is not None else None)
