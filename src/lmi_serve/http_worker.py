"""JsonErrorWorker: gunicorn's gthread worker, with the HTTP layer's own errors answered in JSON.

gunicorn answers a request it cannot parse (a bad request line, a negative Content-Length, CR, LF
or NUL inside a header value, a header block that is too large...) itself, before Flask or any
dialect sees it, with an HTML page. This worker renders those answers as JSON instead, keeping
gunicorn's status, reason and message. No dialect is known before the request parses, so the body
has the shape of the LMI renderer for paths no dialect owns: `{"code", "type", "message", "error"}`.
"""

from __future__ import annotations

import json
import socket

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from .drain import on_worker_sigterm


def error_type(reason: str) -> str:
    """`Bad Request` -> `BadRequestException`, as the LMI error types are spelled."""
    return "".join(word[:1].upper() + word[1:] for word in reason.split()) + "Exception"


def json_error_response(status: int, reason: str, message: str) -> bytes:
    """The whole HTTP/1.1 response: JSON body, and the connection closed (the stream is unusable)."""
    text = message or reason
    body = json.dumps({"code": status, "type": error_type(reason), "message": text, "error": text}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def write_json_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    """Drop-in for `gunicorn.util.write_error` (same signature), writing JSON instead of HTML."""
    util.write_nonblock(sock, json_error_response(status_int, reason, mesg))


class JsonErrorWorker(ThreadWorker):
    """gunicorn's gthread worker; `Worker.handle_error` keeps mapping each parse error to its status
    and message, and only the writer of its error page is replaced, in this worker process."""

    def init_process(self) -> None:
        util.write_error = write_json_error  # Worker.handle_error's only writer of error pages
        super().init_process()

    def handle_exit(self, sig, frame) -> None:
        """SIGTERM: drain first (drain.py), then gunicorn's own stop."""
        on_worker_sigterm(getattr(self, "wsgi", None), lambda: super(JsonErrorWorker, self).handle_exit(sig, frame))
