"""LMI's rendering of the core's error kinds: the route table (`lmi.errors.render_kind`) and the
rolling-batch handler's own answers (`rolling.handler_error`), plain LMI and tgi_compat."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from flask import Flask

from lmi_serve.dialects.lmi import errors as lmi_errors
from lmi_serve.dialects.lmi.rolling import RollingBatchService, handler_error
from lmi_serve.errors import (
    KINDS, ClientGone, ContextOverflow, GenerationFailed, InvalidRequest, NotFound, NotReady, Overloaded,
    ServingError, Timeout, lookup,
)
from lmi_serve.handler_api import Input

# kind -> (status, DJL exception name) on any LMI route
ROUTE = {
    InvalidRequest: (400, "BadRequestException"),
    ContextOverflow: (400, "BadRequestException"),
    NotFound: (404, "ModelNotFoundException"),
    NotReady: (503, "ServiceUnavailableException"),
    Overloaded: (503, "WlmCapacityException"),
    Timeout: (504, "TimeoutException"),
    GenerationFailed: (424, "InvokeHandlerFailure"),
    ClientGone: (499, "ClientClosedRequest"),
}

# kind -> the rolling handler's (status, body) for a kind it answers itself; a kind left out propagates
# to the route (ROUTE above).
PLAIN = {
    InvalidRequest: (424, {"error": "boom", "code": 424}),
    ContextOverflow: (424, {"error": "boom", "code": 424}),
    GenerationFailed: (424, {"error": "boom", "code": 424}),
}
TGI_COMPAT = {
    InvalidRequest: (422, {"error": "boom", "error_type": "validation"}),
    ContextOverflow: (422, {"error": "boom", "error_type": "validation"}),
    GenerationFailed: (424, {"error": "boom", "error_type": "generation"}),
    Overloaded: (429, {"error": "Model is overloaded", "error_type": "overloaded"}),  # TGI's own words
}


def test_every_kind_is_listed_here():
    assert set(ROUTE) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_every_kind_has_a_row_of_its_own_or_its_parents(kind):
    # Not the ServingError fallback (500): that row is for kinds a future core adds.
    assert lookup(lmi_errors.ERROR_TABLE, kind("boom")) != lmi_errors.ERROR_TABLE[ServingError]


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_route_renders_each_kind(kind):
    status, error_type = ROUTE[kind]
    with Flask(__name__).app_context():
        response = lmi_errors.render_kind(kind("boom"))
    assert response.status_code == status and response.mimetype == "application/json"
    assert json.loads(response.get_data()) == {"code": status, "type": error_type, "message": "boom",
                                               "error": "boom"}


@pytest.mark.parametrize("tgi_compat, table", [(False, PLAIN), (True, TGI_COMPAT)], ids=["lmi", "tgi_compat"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_handler_answers_or_leaves_to_the_route(kind, tgi_compat, table):
    output = handler_error(kind("boom"), tgi_compat=tgi_compat)
    if kind not in table:
        assert output is None
        return
    status, body = table[kind]
    assert (output.code, output.message) == (status, "invoke handler failure")
    assert json.loads(output.body()) == body and output.content_type() == "application/json"


# --- through the handler ----------------------------------------------------------------------

class FailedGeneration:
    """A Generation whose request failed before its first token: `start` and `results` raise."""

    def __init__(self, error: BaseException):
        self.error = error

    def start(self):
        raise self.error

    def results(self, client_gone=None):
        raise self.error


class FakeEngine:
    """Enough of an Engine for RollingBatchService: `generate` (or `beam_search`) raises `error`,
    or with `at_start`, `generate` queues and the Generation raises it before the first token."""

    eos_token_ids = frozenset({2})
    max_model_len = 64

    def __init__(self, error: BaseException, *, at_start: bool = False):
        self.error, self.at_start = error, at_start

    def tokenizer(self, text: str):
        return SimpleNamespace(input_ids=[5, 6, 7])

    def generate(self, requests):
        if self.at_start:
            return FailedGeneration(self.error)
        raise self.error

    def beam_search(self, request, num_beams, client_gone=None):
        raise self.error


def invoke(body: bytes, error: BaseException = GenerationFailed("boom"), *, tgi_compat: bool = False,
           content_type: str = "application/json", at_start: bool = False):
    service = RollingBatchService(FakeEngine(error, at_start=at_start), max_input_len=32, tgi_compat=tgi_compat)
    return service.inference(Input.from_http(body, {"Content-Type": content_type}, [], "req-1"))


# where the kind comes from: engine.generate itself, or the Generation before its first token of a
# whole response (results) or of a stream (start)
WHERE = {"generate": (b'{"inputs": "hi"}', False), "results": (b'{"inputs": "hi"}', True),
         "start": (b'{"inputs": "hi", "stream": true}', True)}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("tgi_compat, table", [(False, PLAIN), (True, TGI_COMPAT)], ids=["lmi", "tgi_compat"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_a_kind_raised_by_the_engine(kind, tgi_compat, table, where):
    body, at_start = WHERE[where]
    error = kind("boom")
    if kind not in table:
        with pytest.raises(kind) as caught:
            invoke(body, error, tgi_compat=tgi_compat, at_start=at_start)
        assert caught.value is error  # as raised: the route renders it with ROUTE's row
        return
    output = invoke(body, error, tgi_compat=tgi_compat, at_start=at_start)
    assert (output.code, json.loads(output.body())) == table[kind]
    assert not output.is_stream()


@pytest.mark.parametrize("body, content_type, message", [
    (b'{"inputs": "hi", "parameters": {"top_k": "many"}}', "application/json", "parameters.top_k: "),
    (b'{"inputs": ', "application/json", "Input is not valid JSON"),
    (b"\xff\xfe", "text/plain", "codec can't decode"),
    (b'{"inputs": "hi", "parameters": {"output_formatter": "xml"}}', "application/json", "unknown output formatter"),
])
@pytest.mark.parametrize("tgi_compat", [False, True], ids=["lmi", "tgi_compat"])
def test_bad_requests_are_invalid_requests(body, content_type, message, tgi_compat):
    output = invoke(body, tgi_compat=tgi_compat, content_type=content_type)
    answer = json.loads(output.body())
    assert message in answer["error"]
    if tgi_compat:
        assert output.code == 422 and answer["error_type"] == "validation"
    else:
        assert output.code == 424 and answer["code"] == 424


def test_a_prompt_over_the_input_limit():
    service = RollingBatchService(FakeEngine(GenerationFailed("unused")), max_input_len=2)
    output = service.inference(Input.from_http(b'{"inputs": "hi"}', {"Content-Type": "application/json"}, [], "r"))
    assert (output.code, json.loads(output.body())) == (
        424, {"error": "Input has 3 tokens, over the limit of 2", "code": 424})


@pytest.mark.parametrize("tgi_compat, status, key", [(False, 424, "code"), (True, 424, "error_type")])
def test_a_failed_beam_search_is_a_generation_failure(tgi_compat, status, key):
    body = b'{"inputs": "hi", "parameters": {"num_beams": 2}}'
    output = invoke(body, RuntimeError("no memory for beams"), tgi_compat=tgi_compat)
    answer = json.loads(output.body())
    assert output.code == status and answer["error"] == "exception occurred during beam search: no memory for beams"
    assert answer[key] == (424 if key == "code" else "generation")


@pytest.mark.parametrize("tgi_compat, table", [(False, PLAIN), (True, TGI_COMPAT)], ids=["lmi", "tgi_compat"])
@pytest.mark.parametrize("kind", [Overloaded, Timeout], ids=lambda kind: kind.__name__)
def test_beam_search_keeps_the_core_kinds(kind, tgi_compat, table):
    # A kind is not "a failed beam search": it gets its own answer, as for sampled requests.
    body = b'{"inputs": "hi", "parameters": {"num_beams": 2}}'
    if kind not in table:
        with pytest.raises(kind):
            invoke(body, kind("boom"), tgi_compat=tgi_compat)
    else:
        output = invoke(body, kind("boom"), tgi_compat=tgi_compat)
        assert (output.code, json.loads(output.body())) == table[kind]


@pytest.mark.parametrize(("kind", "status", "error_type"), [
    ("AlreadyExists", 409, "ConflictStatusException"),  # SageMaker MME: that model name is loaded
    ("OutOfResources", 507, "InsufficientStorageException"),  # SageMaker MME: unload some, then retry
    ("Forbidden", 403, "ForbiddenException"),
])
def test_the_management_kinds_have_sagemakers_statuses_here_and_their_parents_elsewhere(kind, status, error_type):
    from lmi_serve import errors

    error = getattr(errors, kind)("boom")
    assert type(error) in errors.MANAGEMENT_KINDS
    assert lookup(lmi_errors.ERROR_TABLE, error) == (status, error_type)
    parent = type(error).__mro__[1]
    assert parent in KINDS and isinstance(error, parent)  # what the other dialects' tables answer
