"""request_reader.request_extent: when the event loop has a whole request, must wait, or must hand
the connection over at once (for gunicorn's own answer), for each framing a request can have."""

from __future__ import annotations

import pytest

from lmi_serve.request_reader import HAND_OVER, NEED_MORE, Limits, request_extent

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
