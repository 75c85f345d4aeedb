"""body_limit.ServingRequest: a chunked body over the limit is refused, never truncated."""

from __future__ import annotations

from io import BytesIO

import pytest
from flask import Flask
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.test import EnvironBuilder

from lmi_serve.server.body_limit import ServingRequest

LIMIT = 100


def chunked_request(body: bytes) -> ServingRequest:
    """A request as gunicorn hands over a chunked body: no Content-Length, input terminated."""
    environ = EnvironBuilder(method="POST", input_stream=BytesIO(body)).get_environ()
    environ.pop("CONTENT_LENGTH", None)
    environ["wsgi.input_terminated"] = True
    return ServingRequest(environ)


@pytest.fixture()
def app_context():
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = LIMIT
    with app.app_context():
        yield


@pytest.mark.parametrize("size", [0, 1, LIMIT])
def test_a_chunked_body_up_to_the_limit_is_read_whole(app_context, size: int) -> None:
    body = bytes(range(256))[:size] if size <= 256 else b"x" * size
    assert chunked_request(body).get_data() == body


@pytest.mark.parametrize("size", [LIMIT + 1, 10 * LIMIT])
def test_a_chunked_body_over_the_limit_is_refused(app_context, size: int) -> None:
    with pytest.raises(RequestEntityTooLarge):
        chunked_request(b"x" * size).get_data()
    with pytest.raises(RequestEntityTooLarge):
        chunked_request(b"x" * size).stream.read()


def test_a_body_with_a_length_keeps_werkzeugs_check(app_context) -> None:
    environ = EnvironBuilder(method="POST", data=b"x" * (LIMIT + 1)).get_environ()
    with pytest.raises(RequestEntityTooLarge):
        ServingRequest(environ).get_data()
    assert ServingRequest(EnvironBuilder(method="POST", data=b"abc").get_environ()).get_data() == b"abc"
