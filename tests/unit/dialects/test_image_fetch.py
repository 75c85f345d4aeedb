"""option.image_fetch against a real HTTP server on loopback: what each mode fetches and refuses,
redirects, the size and time limits. Every refusal is a 400 naming the content part."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmi_serve.errors import InvalidRequest
from lmi_serve.dialects.common import image_fetch
from lmi_serve.dialects.common.image_fetch import FetchPolicy, fetch_image

WHERE = "messages[0].content[1]"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


class Images(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        routes = {
            "/a.png": lambda: self.answer(200, PNG),
            "/moved": lambda: self.answer(302, b"", Location="/a.png"),
            "/loop": lambda: self.answer(302, b"", Location="/loop"),
            "/gone": lambda: self.answer(404, b"no"),
            "/slow": self.slow,
            "/unsized": self.unsized,
        }
        routes.get(self.path.split("?")[0], lambda: self.answer(404, b""))()

    def answer(self, status, body, **headers):
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def slow(self):
        time.sleep(3)
        self.answer(200, PNG)

    def unsized(self):  # no Content-Length: only counting finds the size
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(8):
            self.wfile.write(PNG)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def refused(url, policy) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        fetch_image(url, WHERE, policy)
    assert caught.value.param == WHERE and caught.value.message.startswith(WHERE)
    return caught.value


def test_any_fetches_the_file_and_follows_a_redirect(server):
    assert fetch_image(f"{server}/a.png", WHERE, FetchPolicy("any")) == PNG
    assert fetch_image(f"{server}/moved", WHERE, FetchPolicy("any")) == PNG


def test_off_fetches_nothing(server):
    assert "option.image_fetch=off" in refused(f"{server}/a.png", FetchPolicy("off")).message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "169.254.169.254", "10.0.0.1", "[::1]"])
def test_public_refuses_private_and_local_addresses_before_connecting(host):
    assert "private or local address" in refused(f"http://{host}:9/a.png", FetchPolicy("public")).message


def test_public_checks_a_redirects_target_too(server, monkeypatch):
    # The first hop passes as if public (its check is bypassed here); the redirect's target is loopback.
    checked = []
    real = image_fetch._checked_address

    def first_passes(host, port, where, policy):
        checked.append(host)
        return real(host, port, where, FetchPolicy("any") if len(checked) == 1 else policy)

    monkeypatch.setattr(image_fetch, "_checked_address", first_passes)
    assert "private or local address" in refused(f"{server}/moved", FetchPolicy("public")).message
    assert len(checked) == 2


def test_errors_redirect_loops_sizes_and_time_are_refused(server, monkeypatch):
    assert "answered HTTP 404" in refused(f"{server}/gone", FetchPolicy("any")).message
    assert "redirects more than" in refused(f"{server}/loop", FetchPolicy("any")).message
    started = time.monotonic()
    assert "option.image_fetch_timeout" in refused(f"{server}/slow", FetchPolicy("any", timeout=0.5)).message
    assert time.monotonic() - started < 2.5  # cut at the timeout, not after the server's 3 s
    assert "does not resolve" in refused("http://no-such-host.invalid/a.png", FetchPolicy("any")).message
    monkeypatch.setattr(image_fetch, "MAX_IMAGE_BYTES", len(PNG) * 2)
    assert "is over" in refused(f"{server}/unsized", FetchPolicy("any")).message  # counted
    monkeypatch.setattr(image_fetch, "MAX_IMAGE_BYTES", len(PNG) - 1)
    assert "is over" in refused(f"{server}/a.png", FetchPolicy("any")).message  # by Content-Length
