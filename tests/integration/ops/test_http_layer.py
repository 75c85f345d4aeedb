"""What the HTTP layer itself answers: gunicorn's parse errors in JSON, and the `model_name` header."""

from __future__ import annotations

import json
import socket

import pytest
import requests
from text_generation import Client
from text_generation.errors import BadRequestError

pytestmark = pytest.mark.integration

ROUTES = ["/invocations", "/generate", "/", "/v1/chat/completions", "/v2/models/x/infer", "/ping"]
MALFORMED_HEADERS = {
    "negative Content-Length": b"Content-Length: -1\r\n",
    "CR in a header value": b"x-request-id: a\rb\r\n",
    "LF in a header value": b"x-request-id: a\nb\r\n",
    "NUL in a header value": b"x-request-id: a\x00b\r\n",
}


def exchange(server, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `raw` on a fresh connection; read the answer until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(":", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.strip().lower(): v.strip() for k, v in headers.items()}, body


def assert_json_error(answer: tuple[int, dict[str, str], bytes], status: int) -> dict:
    code, headers, body = answer
    assert code == status and headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert payload["code"] == status and payload["type"].endswith("Exception")
    assert isinstance(payload["error"], str) and payload["error"] == payload["message"]
    return payload


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("problem", MALFORMED_HEADERS)
def test_malformed_headers_get_a_json_400_on_every_route(default_server, route, problem):
    raw = (f"POST {route} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n".encode()
           + MALFORMED_HEADERS[problem] + b"\r\n{}")
    assert_json_error(exchange(default_server, raw), 400)
    assert requests.get(default_server.url("/ping"), timeout=30).status_code == 200


@pytest.mark.parametrize("request_line, status", [
    (b"NOT A REQUEST LINE", 400),
    (b"GET /ping HTTP/9.9", 400),
    (b"GET /" + b"a" * 10_000 + b" HTTP/1.1", 414),
])
def test_bad_request_lines_get_json(default_server, request_line, status):
    assert_json_error(exchange(default_server, request_line + b"\r\nHost: test\r\n\r\n"), status)
    assert requests.get(default_server.url("/ping"), timeout=30).status_code == 200


def test_the_text_generation_client_reads_the_http_layer_error(default_server):
    client = Client(default_server.base, headers={"x-request-id": "a\x00b"}, timeout=30)
    with pytest.raises(BadRequestError):
        client.generate("Hi", max_new_tokens=2)


def test_model_name_header_selects_the_model(store_server):
    body = {"inputs": ["a", "b"]}
    by_header = requests.post(store_server.url("/invocations"), json=body, headers={"model_name": "fallback"},
                              timeout=120)
    by_query = requests.post(store_server.url("/invocations?model_name=fallback"), json=body, timeout=120)
    default = requests.post(store_server.url("/invocations"), json=body, timeout=120)
    assert by_header.status_code == by_query.status_code == default.status_code == 200
    assert [len(vector) for vector in by_header.json()] == [384, 384]
    assert by_header.json() == by_query.json() != default.json()
    unknown = requests.post(store_server.url("/invocations"), json=body, headers={"model_name": "nope"}, timeout=60)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


@pytest.mark.parametrize("route", [*ROUTES[:4], "/v2/models/simple/infer"])
def test_a_malformed_chunked_body_is_a_400_in_the_routes_shape(default_server, route):
    raw = (f"POST {route} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
           "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n").encode()
    status, headers, body = exchange(default_server, raw)
    assert status == 400 and headers["content-type"] == "application/json"
    assert "could not be read" in json.dumps(json.loads(body))
    assert requests.get(default_server.url("/ping"), timeout=30).status_code == 200
