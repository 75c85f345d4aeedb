"""OpenAI's one error table: every core kind has its own row, and render_kind answers with the
row's status, OpenAI's error object, and retry-after on a 429."""

from __future__ import annotations

import pytest
from flask import Flask

from lmi_serve import errors
from lmi_serve.dialects.openai.errors import ERROR_TABLE, kind_body, render_kind, status

EXPECTED = {  # kind -> (status, type, code when the error brings none)
    errors.InvalidRequest: (400, "invalid_request_error", None),
    errors.ContextOverflow: (400, "invalid_request_error", "context_length_exceeded"),
    errors.NotFound: (404, "not_found_error", "model_not_found"),
    errors.NotReady: (503, "service_unavailable", None),
    errors.Overloaded: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    errors.Timeout: (504, "timeout", "timeout"),
    errors.GenerationFailed: (500, "server_error", None),
    errors.ClientGone: (499, "invalid_request_error", None),
}


@pytest.fixture(scope="module")
def app_context():
    with Flask(__name__).app_context():
        yield


def test_every_kind_has_its_own_row():
    assert set(EXPECTED) == set(errors.KINDS)
    assert all(kind in ERROR_TABLE for kind in errors.KINDS)
    assert errors.ServingError in ERROR_TABLE  # the fallback for a kind added later


@pytest.mark.parametrize("kind", errors.KINDS, ids=lambda kind: kind.__name__)
def test_render_kind_gives_the_rows_status_and_openais_error_object(app_context, kind):
    code, error_type, default_code = EXPECTED[kind]
    error = kind("what went wrong", param="model")
    response = render_kind(error)
    assert response.status_code == code == status(error)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert body == {"error": {"message": "what went wrong", "type": error_type, "param": "model",
                              "code": default_code}}
    assert body == kind_body(error)  # a stream's last chunk is the same object
    assert (response.headers.get("retry-after") == "1") == (code == 429)


def test_an_errors_own_code_wins_over_the_rows():
    error = errors.InvalidRequest("bad seed", param="seed", code="invalid_seed")
    assert kind_body(error)["error"] == {"message": "bad seed", "type": "invalid_request_error", "param": "seed",
                                         "code": "invalid_seed"}


def test_a_kind_without_a_row_falls_back_to_a_500(app_context):
    class Unlisted(errors.ServingError):
        pass

    response = render_kind(Unlisted("surprise"))
    assert response.status_code == 500
    assert response.get_json()["error"] == {"message": "surprise", "type": "server_error", "param": None,
                                            "code": None}
