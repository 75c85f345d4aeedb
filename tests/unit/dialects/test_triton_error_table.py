"""Triton's one error table: every core kind has its own row, rendered as Triton's `{"error"}` body."""

from __future__ import annotations

import pytest
from flask import Flask

from lmi_serve import errors
from lmi_serve.dialects.triton.protocol import ERROR_TABLE, render_kind

STATUSES = {
    errors.InvalidRequest: 400,
    errors.ContextOverflow: 400,
    errors.NotFound: 404,
    errors.NotReady: 503,
    errors.Overloaded: 503,
    errors.Timeout: 503,
    errors.GenerationFailed: 500,
    errors.ClientGone: 499,
}


def test_every_kind_is_listed_here():
    assert set(STATUSES) == set(errors.KINDS)


@pytest.mark.parametrize("kind", errors.KINDS, ids=lambda kind: kind.__name__)
def test_every_kind_has_its_own_row_not_the_fallback(kind):
    # A kind answered by the ServingError fallback would be one nobody decided on.
    own_row = next(cls for cls in kind.__mro__ if cls in ERROR_TABLE)
    assert own_row is not errors.ServingError
    assert errors.lookup(ERROR_TABLE, kind("boom")) == STATUSES[kind]


@pytest.mark.parametrize("kind", errors.KINDS, ids=lambda kind: kind.__name__)
def test_render_kind_answers_the_status_with_an_error_body(kind):
    with Flask(__name__).app_context():
        response = render_kind(kind("what went wrong"))
    assert response.status_code == STATUSES[kind]
    assert response.mimetype == "application/json"
    assert response.get_json() == {"error": "what went wrong"}


def test_a_lone_surrogate_in_a_message_still_renders_as_utf8():
    with Flask(__name__).app_context():
        response = render_kind(errors.GenerationFailed("bad \ud800 text"))
    assert response.status_code == 500 and response.get_json() == {"error": "bad \\ud800 text"}
