"""request_reader: when the event loop has a whole request, must wait, or must hand the connection
over at once (for gunicorn's own answer), for each framing a request can have; and ReadingFront on
real sockets and a real selector: handing over, client closes, deadlines (408) and the cap."""

from __future__ import annotations

import selectors
import socket

import pytest

from lmi_serve.server import request_reader
from lmi_serve.server.request_reader import HAND_OVER, NEED_MORE, Limits, ReadingFront, request_extent

HEAD = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_head_without_a_body_is_whole_at_its_blank_line_and_not_before():
    request = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
    for cut in range(len(request)):
        assert request_extent(request[:cut]) == NEED_MORE
    assert request_extent(request) == len(request)
    assert request_extent(request + b"GET /next") == len(request)  # a pipelined request stays behind
    assert request_extent(b"\r\n" + request) == len(request) + 2  # one empty line first is allowed


def test_a_content_length_body_is_waited_for_byte_by_byte():
    request = HEAD + b"Content-Length: 11\r\n\r\n" + b'{"inputs":1}'[:11]
    head = len(request) - 11
    for cut in range(head, len(request)):
        assert request_extent(request[:cut]) == NEED_MORE
    assert request_extent(request) == len(request)
    empty = HEAD + b"content-length:  0 \r\n\r\n"
    assert request_extent(empty) == len(empty)


def test_a_chunked_body_is_whole_after_its_last_chunk_and_trailers():
    body = b"4;ext=1\r\nabcd\r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\n"
    request = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body
    for cut in range(len(request) - len(body), len(request)):
        assert request_extent(request[:cut]) == NEED_MORE
    assert request_extent(request) == len(request)


@pytest.mark.parametrize("fields", [
    b"Content-Length: -1\r\n",  # gunicorn's 400
    b"Content-Length: 1\r\nContent-Length: 1\r\n",
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Expect: 100-continue\r\nContent-Length: 5\r\n",  # the client waits for an answer first
    b"Content-Length: %d\r\n" % (Limits().body + 1),  # too large to hold: the application may refuse it
    b"no colon here\r\n",
])
def test_what_the_scan_does_not_frame_is_handed_over_without_its_body(fields):
    assert request_extent(HEAD + fields + b"\r\n") == HAND_OVER


def test_what_gunicorn_refuses_early_is_handed_over_before_the_head_ends():
    assert request_extent(b"GET /" + b"a" * 5000) == HAND_OVER  # request line over 4094
    assert request_extent(b"GET / HTTP/1.1\nHost: x") == HAND_OVER  # bare LF
    assert request_extent(b"GET / HTTP/1.1\r\nX: " + b"a" * Limits().head) == HAND_OVER
    assert request_extent(HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n") == HAND_OVER
    assert request_extent(HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabcd") == HAND_OVER  # no CRLF after data


class Conn:
    """What ReadingFront uses of gunicorn's TConn: the socket and the peer's address."""

    def __init__(self, sock: socket.socket):
        self.sock, self.client = sock, ("127.0.0.1", 1)


class Front:
    """A ReadingFront on a real selector, recording what it hands over and drops (and closing those)."""

    def __init__(self):
        self.poller = selectors.DefaultSelector()
        self.handed: list[tuple[Conn, bytes]] = []
        self.dropped: list[Conn] = []
        self.front = ReadingFront(self.poller, Limits(), lambda conn, data: self.handed.append((conn, data)),
                                  self.drop, b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        self.peers: list[socket.socket] = []

    def drop(self, conn: Conn) -> None:  # as the worker does
        self.dropped.append(conn)
        conn.sock.close()

    def connect(self, buffered: bytes = b"") -> tuple[Conn, socket.socket]:
        ours, peer = socket.socketpair()
        self.peers.append(peer)
        conn = Conn(ours)
        self.front.start(conn, buffered)
        return conn, peer

    def pump(self) -> None:
        for key, _ in self.poller.select(timeout=0.2):
            key.data(key.fileobj)


@pytest.fixture
def front():
    front = Front()
    yield front
    for peer in front.peers:
        peer.close()
    front.poller.close()


def test_a_request_sent_in_pieces_is_handed_over_whole_with_what_follows_it(front):
    conn, peer = front.connect(b"POST / HTTP/1.1\r\nContent-")  # bytes a previous read left behind
    for piece in (b"Length: 4\r\n", b"\r\nab", b"cdGET /next"):
        assert front.handed == []
        peer.sendall(piece)
        front.pump()
    assert front.handed == [(conn, b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcdGET /next")]
    assert front.front.reading == {} and not front.poller.get_map()


def test_a_client_that_closes_mid_request_is_handed_over_and_one_that_sent_nothing_is_dropped(front):
    partial, peer = front.connect()
    peer.sendall(b"GET / HT")
    peer.shutdown(socket.SHUT_WR)
    silent, quiet_peer = front.connect()
    quiet_peer.shutdown(socket.SHUT_WR)
    front.pump()
    front.pump()
    assert front.handed == [(partial, b"GET / HT")]  # gunicorn's parser decides what that was
    assert front.dropped == [silent]


def test_past_its_deadline_a_partial_request_gets_408_and_a_silent_connection_is_just_closed(front, monkeypatch):
    monkeypatch.setattr(request_reader, "HEAD_TIMEOUT", 0.0)
    partial, peer = front.connect(b"GET / HTTP/1.1\r\n")
    silent, quiet_peer = front.connect()
    front.front.check()
    assert front.dropped == [partial, silent] and front.handed == []
    assert peer.recv(100).startswith(b"HTTP/1.1 408 ")
    quiet_peer.settimeout(5)
    assert quiet_peer.recv(100) == b""  # no answer before its close


def test_while_the_worker_stops_a_new_connection_gets_a_moment_to_send_its_request(front):
    fresh, fresh_peer = front.connect()
    stale, _ = front.connect()
    front.front.reading[stale].started -= request_reader.STOP_SILENT_GRACE  # silent for the whole grace already
    front.front.check(alive=False)
    assert front.dropped == [stale] and list(front.front.reading) == [fresh]
    fresh_peer.sendall(b"GET /ping HTTP/1.1\r\n\r\n")  # accepted just before the stop: its request comes
    front.pump()
    assert front.handed == [(fresh, b"GET /ping HTTP/1.1\r\n\r\n")] and front.dropped == [stale]


def test_past_the_cap_the_oldest_connection_being_read_is_answered_408(front, monkeypatch):
    monkeypatch.setattr(request_reader, "MAX_READING", 2)
    first, first_peer = front.connect(b"GET / HTTP/1.1\r\n")
    second, _ = front.connect()
    third, _ = front.connect()
    assert front.dropped == [first] and list(front.front.reading) == [second, third]
    assert first_peer.recv(100).startswith(b"HTTP/1.1 408 ")
