"""Anthropic's one error table: every core kind has its own row, and render_kind answers with the
row's status and Anthropic's error object, which the official client's ErrorResponse type reads."""

from __future__ import annotations

import pytest
from anthropic.types import ErrorResponse
from flask import Flask

from lmi_serve import errors
from lmi_serve.dialects.anthropic.errors import ERROR_TABLE, error_response, kind_body, render_kind, status
from lmi_serve.json_body import InvalidJson

EXPECTED = {  # kind -> (status, Anthropic's error type)
    errors.InvalidRequest: (400, "invalid_request_error"),
    errors.ContextOverflow: (400, "invalid_request_error"),
    errors.NotFound: (404, "not_found_error"),
    errors.NotReady: (503, "overloaded_error"),
    errors.Overloaded: (529, "overloaded_error"),
    errors.Timeout: (504, "timeout_error"),
    errors.GenerationFailed: (500, "api_error"),
    errors.ClientGone: (499, "invalid_request_error"),
}


@pytest.fixture(scope="module")
def app_context():
    with Flask(__name__).app_context():
        yield


def test_every_kind_has_its_own_row():
    assert set(EXPECTED) == set(errors.KINDS)
    assert all(kind in ERROR_TABLE for kind in errors.KINDS) and InvalidJson in ERROR_TABLE
    assert errors.ServingError in ERROR_TABLE  # the fallback for a kind added later


@pytest.mark.parametrize("kind", errors.KINDS, ids=lambda kind: kind.__name__)
def test_render_kind_gives_the_rows_status_and_anthropics_error_object(app_context, kind):
    code, error_type = EXPECTED[kind]
    error = kind("what went wrong", param="model")
    response = render_kind(error)
    assert response.status_code == code == status(error)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert body == {"type": "error", "error": {"type": error_type, "message": "what went wrong"}}
    assert body == kind_body(error)  # a stream's `error` event is the same object
    ErrorResponse.model_validate(body)  # the official client's type for it
    assert (response.headers.get("retry-after") == "1") == (code == 529)  # a full queue: the client retries


@pytest.mark.parametrize(("code", "error_type"), [(401, "authentication_error"), (403, "permission_error"),
                                                  (404, "not_found_error"), (405, "invalid_request_error"),
                                                  (413, "invalid_request_error"), (500, "api_error")])
def test_http_errors_on_these_routes_are_anthropics_too(app_context, code, error_type):
    body = error_response(code, "SomeException", "no").get_json()
    assert body == {"type": "error", "error": {"type": error_type, "message": "no"}}
    ErrorResponse.model_validate(body)


def test_a_kind_without_a_row_falls_back_to_a_500(app_context):
    class Unlisted(errors.ServingError):
        pass

    response = render_kind(Unlisted("surprise"))
    assert response.status_code == 500
    assert response.get_json()["error"] == {"type": "api_error", "message": "surprise"}
