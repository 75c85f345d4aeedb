"""JsonErrorWorker: gunicorn's gthread worker, with the HTTP layer's own errors answered in JSON.

gunicorn answers a request it cannot parse (a bad request line, a negative Content-Length, CR, LF
or NUL inside a header value, a header block that is too large...) itself, before Flask or any
dialect sees it, with an HTML page. This worker renders those answers as JSON instead, keeping
gunicorn's status, reason and message. No dialect is known before the request parses, so the body
has the shape of the LMI renderer for paths no dialect owns: `{"code", "type", "message", "error"}`.

It also reads each request in its event loop before a request thread takes it (request_reader.py),
so slow or idle clients hold no thread: a request not received in time is answered 408, in JSON.
"""

from __future__ import annotations

import json
import socket

from gunicorn import http, util
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import ThreadWorker

from lmi_serve.server.drain import on_worker_sigterm
from lmi_serve.server.request_reader import Limits, ReadingFront


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
    and message, and only the writer of its error page is replaced, in this worker process.

    Every connection gthread would give to its thread pool (new, kept-alive and readable, or with a
    pipelined request already buffered) goes through `enqueue_req`, which here starts reading the
    request in the event loop instead; the pool gets it once it is whole (request_reader.py)."""

    front: ReadingFront | None = None

    def init_process(self) -> None:
        util.write_error = write_json_error  # Worker.handle_error's only writer of error pages
        super().init_process()

    def run(self) -> None:
        # TLS and the PROXY protocol put bytes before the request that only gunicorn reads: there
        # every connection goes straight to the pool, as in gthread.
        if not self.cfg.is_ssl and self.cfg.proxy_protocol == "off":
            self.front = ReadingFront(self.poller, Limits.from_gunicorn(self.cfg), self._hand_over, self._drop,
                                      json_error_response(408, "Request Timeout",
                                                          "the request was not received in time"))
        super().run()

    def enqueue_req(self, conn) -> None:
        """Read the connection's next request in the event loop (runs on the main thread)."""
        if self.front is None or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            super().enqueue_req(conn)
            return
        buffered = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        self.front.start(conn, buffered)

    def _hand_over(self, conn, data: bytes) -> None:
        """Give the pool a connection whose request was read: gunicorn's parser reads `data` first."""
        if conn.parser is None:
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(data)
        conn.data_ready = True  # the thread must not wait for the socket to become readable
        super().enqueue_req(conn)

    def _drop(self, conn) -> None:
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self) -> None:
        """gthread's timeouts (called every turn of the loop, and while stopping), and the reading ones."""
        super().murder_pending()
        if self.front is not None:
            self.front.check(self.alive)

    def handle_exit(self, sig, frame) -> None:
        """SIGTERM: drain first (drain.py), then gunicorn's own stop."""
        on_worker_sigterm(getattr(self, "wsgi", None), lambda: super(JsonErrorWorker, self).handle_exit(sig, frame))
