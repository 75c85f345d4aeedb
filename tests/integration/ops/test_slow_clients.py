"""Slow and idle connections hold no request thread: requests are read in the worker's event loop
(request_reader.py) and a request thread gets each one whole. Normal requests keep being served
beside 200 slow connections; the slow ones are answered 408 (in JSON) or closed; bytes read ahead
(a trickled chunked body, a pipelined request) still reach gunicorn's parser.
Latency figures are not asserted here: benchmarks/bench_slow_clients.py prints them."""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests
from server_process import wait_for

from benchmarks.benchmark.slow_clients import NORMAL_REQUESTS, NormalLoad, SlowSockets

pytestmark = pytest.mark.integration


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_normal_requests_are_served_beside_200_slow_connections(default_server):
    late = socket.create_connection(("127.0.0.1", default_server.port), timeout=120)
    late.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Le")  # and nothing more
    slow = SlowSockets("127.0.0.1", default_server.port, 200, interval=0.5).start()
    load = NormalLoad(default_server.base, clients=2, timeout=90).start()  # finite: before, they hung
    try:
        # Until every kind of slow connection was answered or closed at least once (the deadlines are
        # 20 s), and each normal request was served a few times meanwhile.
        wait_for(lambda: all(sum(slow.outcomes[kind].values()) >= 10 for kind in slow.outcomes)
                 and all(len(load.latencies[name]) >= 3 for name in NORMAL_REQUESTS), timeout=240)
    finally:
        load.stop()
        slow.stop()
    assert load.failures == []
    for kind in ("head", "body"):
        assert set(slow.outcomes[kind]) - {"open at the end"} <= {"408", "closed"}, slow.outcomes
        assert slow.outcomes[kind]["408"] >= 10, slow.outcomes
    assert set(slow.outcomes["idle"]) - {"open at the end"} == {"closed"}, slow.outcomes

    head, _, body = read_until_closed(late).partition(b"\r\n\r\n")
    late.close()
    assert head.startswith(b"HTTP/1.1 408 ") and b"Content-Type: application/json" in head
    assert json.loads(body)["code"] == 408 and json.loads(body)["type"] == "RequestTimeoutException"

    assert requests.get(default_server.url("/ping"), timeout=30).status_code == 200
    generated = requests.post(default_server.url("/invocations"), timeout=60,
                              json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert generated.status_code == 200 and isinstance(generated.json()["generated_text"], str)


def test_a_trickled_chunked_body_and_a_pipelined_request_reach_the_application(default_server):
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    chunked = (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    pipelined = b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", default_server.port), timeout=120) as sock:
        for i in range(0, len(chunked), 7):  # a few bytes at a time, then both requests' rest at once
            sock.sendall(chunked[i:i + 7] if i + 7 < len(chunked) else chunked[i:] + pipelined)
            time.sleep(0.01)
        answer = read_until_closed(sock)
    first, second = answer.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and b'"generated_text"' in first
    assert second.startswith(b"200 ")
