"""Read each request in the worker's event loop, and give it to a request thread only once it is whole.

gunicorn's gthread worker hands a connection to its thread pool as soon as the connection is
readable; the thread then parses the request with blocking reads, so a client that trickles its
head or body one byte at a time holds that thread for as long as it likes, and a few dozen such
clients take every thread. Here the worker's main loop (one thread, a selector) reads every
request first, without blocking, until `request_extent` says it is complete, then hands the
connection to the pool with the bytes read so far put back in front of gunicorn's parser (its
unreader), so gunicorn parses, validates and answers exactly as before and the request thread
never waits for the client. The socket itself stays the plain socket (disconnect.py watches it).

What is read in the loop, and what is left to the request thread:
- the head, up to what gunicorn would accept (longer: handed over at once, for gunicorn's error);
- a Content-Length body up to `BODY_BUFFER` bytes; a chunked body whose chunks end within the
  buffer bound. Anything the scan cannot frame (a malformed or conflicting length, an unknown
  coding, a request line or head beyond gunicorn's limits, bare LF) is handed over at once, so
  gunicorn's own error answers it, in JSON (http_worker.py).
- a larger declared body, or one that expects `100 Continue`, is handed over after its head: the
  application may refuse it (413) before the upload, and a thread reads the rest, as gunicorn does.

Deadlines (checked about every `CHECK_EVERY` seconds): the head must be complete within
`HEAD_TIMEOUT` of the connection's start (a new connection) or of its first byte (a kept-alive
one); the body then has `BODY_TIMEOUT`, plus one second for every `BODY_MIN_RATE` bytes received.
A request past its deadline is answered 408 in JSON and closed; a new connection that sent nothing
in `HEAD_TIMEOUT` is closed without an answer. At most `MAX_READING` connections are held in this
state; past it the oldest one is treated as timed out, so a flood of slow connections cannot keep
out a new one.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HEAD_TIMEOUT = 20.0
BODY_TIMEOUT = 20.0
BODY_MIN_RATE = 500  # bytes per second: each 500 bytes received extend the body deadline by 1 s
BODY_BUFFER = 1024 * 1024
MAX_READING = 512
CHECK_EVERY = 0.25
# While the worker stops, a connection that sent nothing is closed once it has been silent this long. Not at
# once: a connection accepted just before the stop usually has its request on the way (a drained worker that
# closed such connections at once reset a client's GET /ping in a SIGTERM test, ~1 run in 50).
STOP_SILENT_GRACE = 1.0
RECV_SIZE = 65536
_MAX_HEADERS, _DEFAULT_FIELD_SIZE, _UNLIMITED_LINE = 32768, 8190, 1024 * 1024
_HEX_DIGITS = b"0123456789abcdefABCDEF"

log = logging.getLogger(__name__)

NEED_MORE = -1  # request_extent: not complete yet
HAND_OVER = 0  # request_extent: give it to a request thread now (malformed, large, or not framed here)


@dataclass(frozen=True)
class Limits:
    """gunicorn's head limits, so a head it would refuse is handed over rather than waited on."""

    request_line: int = 4094
    head: int = 100 * (8190 + 2) + 4094 + 4
    body: int = BODY_BUFFER

    @classmethod
    def from_gunicorn(cls, cfg) -> Limits:
        line = cfg.limit_request_line if cfg.limit_request_line > 0 else _UNLIMITED_LINE
        fields = cfg.limit_request_fields if 0 < cfg.limit_request_fields <= _MAX_HEADERS else _MAX_HEADERS
        size = cfg.limit_request_field_size if cfg.limit_request_field_size > 0 else _DEFAULT_FIELD_SIZE
        return cls(request_line=line, head=fields * (size + 2) + line + 4)


def head_length(buf: bytes, limits: Limits) -> int:
    """Bytes of the head including its blank line; NEED_MORE, or HAND_OVER when gunicorn would
    refuse what is there already (a request line or head over its limits, a bare LF)."""
    start = 2 if buf[:2] == b"\r\n" else 0  # one empty line before the request line is allowed
    end = buf.find(b"\r\n\r\n", start)
    head = buf[:end] if end >= 0 else buf
    if head.count(b"\n") != head.count(b"\r\n"):
        return HAND_OVER  # a bare LF: gunicorn answers 400 without waiting
    line_end = buf.find(b"\r\n", start)
    if (line_end if line_end >= 0 else len(buf)) - start > limits.request_line + 2:
        return HAND_OVER
    if end < 0:
        return HAND_OVER if len(buf) > limits.head else NEED_MORE
    return end + 4


def request_extent(buf: bytes, limits: Limits = Limits()) -> int:
    """How many bytes of `buf` make the first request whole: a positive count when they are all
    there, NEED_MORE while some are missing, HAND_OVER when a request thread should take it now."""
    head_end = head_length(buf, limits)
    if head_end <= 0:
        return head_end
    start = 2 if buf[:2] == b"\r\n" else 0
    fields: dict[bytes, list[bytes]] = {}
    for line in buf[start:head_end - 4].split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            return HAND_OVER
        fields.setdefault(name.strip().lower(), []).append(value.strip())
    if b"expect" in fields:
        return HAND_OVER  # the client may wait for 100 Continue before it sends the body
    lengths, codings = fields.get(b"content-length"), fields.get(b"transfer-encoding")
    if codings is not None:
        chunked_last = b",".join(codings).split(b",")[-1].strip().lower() == b"chunked"
        if lengths is not None or not chunked_last:
            return HAND_OVER  # refused by gunicorn, or not framed by this scan
        return chunked_extent(buf, head_end, limits)
    if lengths is None:
        return head_end
    if len(lengths) != 1 or not lengths[0].isdigit() or int(lengths[0]) > limits.body:
        return HAND_OVER
    total = head_end + int(lengths[0])
    return total if len(buf) >= total else NEED_MORE


def chunked_extent(buf: bytes, head_end: int, limits: Limits) -> int:
    """request_extent for a chunked body after a head of `head_end` bytes: the end of its last
    chunk and trailer fields; HAND_OVER for a malformed chunk or a body beyond `limits.body`."""
    pos = head_end
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return HAND_OVER if len(buf) - pos > limits.request_line else NEED_MORE
        size_field = buf[pos:line_end].split(b";", 1)[0].strip()
        if not size_field or size_field.strip(_HEX_DIGITS):
            return HAND_OVER  # malformed: gunicorn's chunk reader answers it
        size = int(size_field, 16)
        pos = line_end + 2
        if size == 0:
            while True:  # trailer fields, then the empty line
                line_end = buf.find(b"\r\n", pos)
                if line_end < 0:
                    return HAND_OVER if len(buf) - pos > limits.head else NEED_MORE
                if line_end == pos:
                    return pos + 2
                pos = line_end + 2
        pos += size + 2
        if pos - head_end > limits.body:
            return HAND_OVER
        if pos > len(buf):
            return NEED_MORE
        if buf[pos - 2:pos] != b"\r\n":
            return HAND_OVER


@dataclass(eq=False)
class Reading:
    """A connection whose request is being read in the event loop."""

    conn: object  # gunicorn's TConn
    buf: bytearray
    started: float
    head_done_at: float | None = None
    head_end: int = 0
    registered: bool = field(default=False, repr=False)

    def deadline(self) -> float:
        if self.head_done_at is None:
            return self.started + HEAD_TIMEOUT
        received = len(self.buf) - self.head_end
        return self.head_done_at + BODY_TIMEOUT + received / BODY_MIN_RATE


class ReadingFront:
    """The connections being read; see the module docstring. Runs on the worker's main thread only.

    `poller` is the worker's selector; `hand_over(conn, data)` gives a connection and the bytes read
    from it to a request thread; `drop(conn)` closes a connection and forgets it (the worker's
    connection count); `timeout_answer` is the whole 408 response.
    """

    def __init__(self, poller, limits: Limits, hand_over: Callable[[object, bytes], None],
                 drop: Callable[[object], None], timeout_answer: bytes):
        self.poller = poller
        self.limits = limits
        self.hand_over = hand_over
        self.drop = drop
        self.timeout_answer = timeout_answer
        self.reading: dict[object, Reading] = {}  # insertion order: oldest first
        self._next_check = 0.0

    def start(self, conn, buffered: bytes) -> None:
        """Read `conn`'s next request here; `buffered` is what was already read from it."""
        while len(self.reading) >= MAX_READING:
            self._expire(next(iter(self.reading.values())), "too many connections being read")
        reading = Reading(conn, bytearray(buffered), time.monotonic())
        if buffered and self._advance(reading):
            return
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda _sock: self._readable(reading))
        reading.registered = True
        self.reading[conn] = reading

    def check(self, alive: bool = True) -> None:
        """Answer 408 to the requests past their deadline (and close the connections that sent
        nothing). While the worker stops, connections that have sent nothing for STOP_SILENT_GRACE are
        closed: a stopping worker does not wait out a silent client's head timeout."""
        now = time.monotonic()
        if now < self._next_check and alive:
            return
        self._next_check = now + CHECK_EVERY
        for reading in list(self.reading.values()):
            silent = not reading.buf and now - reading.started >= STOP_SILENT_GRACE
            if reading.deadline() <= now or (not alive and silent):
                self._expire(reading, "deadline passed" if alive else "worker stopping")

    def _readable(self, reading: Reading) -> None:
        try:
            data = reading.conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._forget(reading)
            self.drop(reading.conn)
            return
        if not data:  # the client closed its side: gunicorn parses what came (or ignores nothing)
            self._forget(reading)
            if reading.buf:
                self.hand_over(reading.conn, bytes(reading.buf))
            else:
                self.drop(reading.conn)
            return
        reading.buf += data
        self._advance(reading)

    def _advance(self, reading: Reading) -> bool:
        """Scan what was read; hand the connection over when the request is whole (or must go)."""
        buf = bytes(reading.buf)
        if reading.head_done_at is None:
            head_end = head_length(buf, self.limits)
            if head_end > 0:
                reading.head_done_at, reading.head_end = time.monotonic(), head_end
        extent = request_extent(buf, self.limits)
        if extent == NEED_MORE and len(buf) < self.limits.body + self.limits.head:
            return False
        self._forget(reading)
        self.hand_over(reading.conn, buf)
        return True

    def _expire(self, reading: Reading, why: str) -> None:
        self._forget(reading)
        sock = reading.conn.sock
        if reading.buf:
            log.debug("408 to %s: request incomplete (%d bytes), %s", reading.conn.client, len(reading.buf), why)
            try:
                sock.send(self.timeout_answer)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self.drop(reading.conn)

    def _forget(self, reading: Reading) -> None:
        if reading.registered:
            reading.registered = False
            try:
                self.poller.unregister(reading.conn.sock)
            except (KeyError, ValueError, OSError):
                pass
        self.reading.pop(reading.conn, None)
