"""TGI's protocol without a server: parsing raw bodies, the error table, the error shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from flask import Flask

from lmi_serve.dialects.tgi.protocol import (
    ERROR_TABLE, NotJson, check_context, error_response, parse_request, render_kind, tgi_error_body,
)
from lmi_serve.errors import (
    KINDS, ClientGone, ContextOverflow, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded, ServingError,
    Timeout,
)


def parse(body, *, default_full_text=False, stream_route=False):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(data, default_full_text=default_full_text, stream_route=stream_route)


@pytest.fixture
def app_context():
    with Flask(__name__).app_context():
        yield


def rendered(error: ServingError) -> tuple[int, dict]:
    response = render_kind(error)
    return response.status_code, response.get_json()


# --- parsing --------------------------------------------------------------------------------

def test_a_good_body_parses_with_values_coerced():
    parsed = parse({"inputs": "Hi", "parameters": {"max_new_tokens": "3", "top_k": "5", "temperature": 0.5}})
    assert parsed.inputs == "Hi" and parsed.stream is False
    assert (parsed.parameters.max_new_tokens, parsed.parameters.top_k, parsed.parameters.temperature) == (3, 5, 0.5)
    assert parsed.parameters.return_full_text is False


def test_tgi_defaults_sampling_full_text_and_streaming():
    assert parse({"inputs": "Hi"}).parameters.do_sample is True  # no parameters object: TGI samples
    assert parse({"inputs": "Hi", "parameters": {}}).parameters.do_sample_resolved is False
    assert parse({"inputs": "Hi"}, default_full_text=True).parameters.return_full_text is True
    kept = parse({"inputs": "Hi", "parameters": {"return_full_text": False}}, default_full_text=True)
    assert kept.parameters.return_full_text is False
    assert parse({"inputs": "Hi"}, stream_route=True).stream is True
    assert parse({"inputs": "Hi", "stream": True}).stream is True
    assert parse({"inputs": "Hi", "stream": None}).stream is False


# (body, stream route, TGI's message after "Input validation error: ")
RULES = [
    ({"inputs": ""}, False, "`inputs` must be a non-empty string"),
    ({"inputs": ["Hi"]}, False, "`inputs` must be a non-empty string"),
    (["Hi"], False, "`inputs` must be a non-empty string"),
    ({"inputs": "Hi", "extra": 1}, False, "unknown field(s) ['extra']"),
    ({"inputs": "Hi", "stream": "false"}, False, "`stream` must be true or false"),
    ({"inputs": "Hi", "parameters": {"temperature": 0}}, False, "`temperature` must be strictly positive"),
    ({"inputs": "Hi", "parameters": {"top_k": "0"}}, False, "`top_k` must be strictly positive"),
    ({"inputs": "Hi", "parameters": {"decoder_input_details": True}}, True,
     "`decoder_input_details` == true is not supported when streaming tokens"),
    ({"inputs": "Hi", "stream": True, "parameters": {"decoder_input_details": True}}, False,
     "`decoder_input_details` == true is not supported when streaming tokens"),
    ({"inputs": "Hi", "parameters": {"num_beams": 2}}, False,
     "`num_beams` is not a TGI parameter; beam search is available on /invocations"),
    ({"inputs": "Hi", "parameters": {"output_formatter": "json"}}, False,
     "`output_formatter` is not a TGI parameter; output formatters apply on /invocations"),
]


@pytest.mark.parametrize("body, stream_route, message", RULES)
def test_each_rule_violation_is_an_invalid_request_in_tgi_words(app_context, body, stream_route, message):
    with pytest.raises(InvalidRequest) as caught:
        parse(body, stream_route=stream_route)
    assert type(caught.value) is InvalidRequest and caught.value.message == message
    assert rendered(caught.value) == (422, {"error": "Input validation error: " + message,
                                            "error_type": "validation"})


@pytest.mark.parametrize("parameters, field", [
    ({"top_k": 2**63}, "top_k"), ({"seed": -1}, "seed"), ({"no_such_parameter": 1}, "no_such_parameter"),
    ("not an object", "parameters"),
])
def test_the_shared_schemas_refusals_are_invalid_requests(parameters, field):
    with pytest.raises(InvalidRequest, match=field):
        parse({"inputs": "Hi", "parameters": parameters})


@pytest.mark.parametrize("body", [b"{", b'{"inputs": "\\ud800"}', b"[" * 1000 + b"]" * 1000,
                                  b'{"inputs": "Hi", "parameters": {"temperature": NaN}}'])
def test_a_body_that_is_not_acceptable_json_is_tgis_400(app_context, body):
    with pytest.raises(NotJson) as caught:
        parse(body)
    status, answer = rendered(caught.value)
    assert status == 400 and answer["error_type"] == "validation"
    assert answer["error"].startswith("The request body")  # no validation prefix: TGI's own 400 wording


def test_context_is_refused_in_tgi_words_not_capped(app_context):
    check_context(10, 6, 16)
    with pytest.raises(ContextOverflow) as caught:
        check_context(10, 7, 16)
    assert rendered(caught.value) == (422, {
        "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 16. Given: 10 `inputs` "
                 "tokens and 7 `max_new_tokens`", "error_type": "validation"})
    with pytest.raises(InvalidRequest, match="no tokens"):
        check_context(0, 1, 16)


# --- the error table ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_its_own_row(kind):
    assert kind in ERROR_TABLE


@pytest.mark.parametrize("error, status, error_type, message", [
    (InvalidRequest("bad"), 422, "validation", "Input validation error: bad"),
    (ContextOverflow("too long"), 422, "validation", "Input validation error: too long"),
    (Overloaded("Model is overloaded: the waiting queue is full"), 429, "overloaded", "Model is overloaded"),
    (Timeout("waited too long"), 424, "generation", "Request failed during generation: waited too long"),
    (GenerationFailed("boom"), 424, "generation", "Request failed during generation: boom"),
    (NotFound("Model nope is not found"), 404, "not_found", "Model nope is not found"),
    (NotReady("Model m is loading"), 503, "healthcheck", "Model m is loading"),
    (ClientGone("gone"), 499, "client_closed_request", "gone"),
    (ServingError("odd"), 500, "internal", "odd"),
])
def test_kinds_render_with_tgi_status_and_error_type(app_context, error, status, error_type, message):
    response = render_kind(error)
    assert response.mimetype == "application/json"
    assert (response.status_code, response.get_json()) == (status, {"error": message, "error_type": error_type})


def test_a_failure_renders_the_same_as_a_response_body_or_a_last_frame(app_context):
    assert rendered(GenerationFailed("boom"))[1] == tgi_error_body("boom")


def test_http_errors_take_tgis_error_type_for_its_statuses(app_context):
    assert error_response(400, "BadRequest", "x").get_json() == {"error": "x", "error_type": "validation"}
    assert error_response(404, "ResourceNotFoundException", "x").get_json()["error_type"] == "ResourceNotFoundException"


def test_the_protocol_imports_without_the_lmi_formatters():
    """lmi.formatters imports tgi.protocol for tgi_compat: the reverse at import time is a cycle."""
    code = ("import sys, lmi_serve.dialects.tgi.protocol; "
            "assert 'lmi_serve.dialects.lmi.formatters' not in sys.modules, 'formatters imported'; "
            "assert 'lmi_serve.dialects.lmi.rolling' not in sys.modules, 'rolling imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
