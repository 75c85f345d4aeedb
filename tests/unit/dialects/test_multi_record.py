"""SageMaker Batch Transform's MultiRecord bodies (dialects/lmi/multi_record.py): which bodies are
several records, how each record is answered in its place, and the wiring through the rolling handler."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from lmi_serve.dialects.lmi import multi_record
from lmi_serve.dialects.lmi.errors import ERROR_TABLE
from lmi_serve.dialects.lmi.rolling import RollingBatchService, handler_error
from lmi_serve.errors import ClientGone, GenerationFailed, InvalidRequest, Overloaded
from lmi_serve.handler_api import Input, Output

A, B, C = b'{"inputs": "a"}', b'{"inputs": "b"}', b'{"inputs": "c"}'


# --- which bodies are several records ------------------------------------------------------------

@pytest.mark.parametrize("body, content_type, expected", [
    (A + b"\n" + B, "application/jsonlines", [A, B]),
    (A + b"\n" + B + b"\n", "application/json", [A, B]),  # SageMaker's final newline is no record
    (A + b"\r\n\n" + B + b"\r\n", "application/x-jsonlines; charset=utf-8", [A + b"\r", B + b"\r"]),
    (A + b"\n" + B, None, [A, B]),  # no type: JSON, as read_payload reads it
    (b"{oops\n" + B, "application/jsonlines", [b"{oops", B]),  # jsonlines: a bad first line is a record
    (A + b"\n{oops", "application/json", [A, b"{oops"]),
])
def test_several_records(body, content_type, expected):
    assert multi_record.split_records(body, content_type) == expected


@pytest.mark.parametrize("body, content_type", [
    (A, "application/jsonlines"),  # one record: the single path, unchanged
    (A + b"\n\n  \n", "application/jsonlines"),
    (b'{\n  "inputs": "a",\n  "parameters": {}\n}', "application/json"),  # a pretty-printed document
    (b'[\n"a",\n"b"\n]', "application/json"),
    (b"{oops\n" + B, "application/json"),  # not jsonlines: a broken first line is one broken document
    (b"line one\nline two", "text/plain"),  # a prompt with newlines
    (A + b"\n" + B, "text/plain; charset=utf-8"),
])
def test_one_record(body, content_type):
    assert multi_record.split_records(body, content_type) is None


def test_a_custom_input_formatter_splits_only_what_says_jsonlines():
    assert multi_record.split_records(A + b"\n" + B, "application/json", sniff=False) is None
    assert multi_record.split_records(A + b"\n" + B, "application/jsonlines", sniff=False) == [A, B]


def test_a_record_keeps_the_request_headers_and_query():
    item = Input.from_http(A + b"\n" + B, {"Content-Type": "application/jsonlines", "Content-Length": "31",
                                           "X-Amzn-SageMaker-Adapter-Identifier": "fr"}, [("q", "1")], "req-1")
    single = multi_record.record_input(item, B + b"\r")
    assert single.get_as_json() == {"inputs": "b"} and single.get_property("Content-Type") == "application/json"
    assert single.get_property("Content-Length") is None
    assert single.get_property("X-Amzn-SageMaker-Adapter-Identifier") == "fr"
    assert single.get_property("requestId") == "req-1" and single.get_as_string("q") == "1"


# --- answering the records -----------------------------------------------------------------------

def answerer(answer, workers=8, tgi_compat=False):
    return multi_record.RecordAnswerer(answer, lambda e: handler_error(e, tgi_compat=tgi_compat),
                                       lambda e: multi_record.route_error_body(ERROR_TABLE, e), workers)


def lines(output: Output) -> list:
    assert output.code == 200 and output.content_type() == "application/jsonlines"
    body = output.body()
    assert body.endswith(b"\n")
    return [json.loads(line) for line in body.decode().split("\n")[:-1]]


def echo(item: Input) -> Output:
    return Output().add({"generated_text": item.get_as_json()["inputs"].upper()})


def test_each_record_answered_in_input_order():
    records = [json.dumps({"inputs": f"r{i}"}).encode() for i in range(20)]
    out = answerer(echo, workers=4).answer_all(Input(), records)
    assert lines(out) == [{"generated_text": f"R{i}"} for i in range(20)]


def test_records_are_in_flight_together():
    # every record's answer waits for all the others to have started: one at a time would deadlock
    barrier = threading.Barrier(5, timeout=10)

    def together(item):
        barrier.wait()
        return echo(item)

    out = answerer(together, workers=5).answer_all(Input(), [A, B, C, A, B])
    assert [line["generated_text"] for line in lines(out)] == ["A", "B", "C", "A", "B"]


def test_bad_records_are_answered_in_place():
    def answer(item):
        payload = item.get_as_json()
        if payload["inputs"] == "overload":
            raise Overloaded("queue full")  # a kind the route renders
        if payload["inputs"] == "bug":
            raise RuntimeError("a bug")
        if payload["inputs"] == "bad":
            return handler_error(InvalidRequest("bad parameters"), tgi_compat=False)
        return echo(item)

    records = [A, b'{"inputs": "bad"}', b'{"inputs": "overload"}', b'{"inputs": "bug"}', B]
    assert lines(answerer(answer).answer_all(Input(), records)) == [
        {"generated_text": "A"},
        {"error": "bad parameters", "code": 424},
        {"code": 503, "type": "WlmCapacityException", "message": "queue full", "error": "queue full"},
        {"code": 500, "type": "InternalServerException", "message": "Internal error answering this record",
         "error": "Internal error answering this record"},
        {"generated_text": "B"},
    ]


@pytest.mark.parametrize("tgi_compat, refusal", [
    (False, {"error": multi_record.STREAM_REFUSED, "code": 424}),
    (True, {"error": multi_record.STREAM_REFUSED, "error_type": "validation"}),
])
def test_a_record_that_streams_is_refused(tgi_compat, refusal):
    seen = []

    def answer(item):
        seen.append(item.get_as_json())
        return echo(item)

    out = answerer(answer, tgi_compat=tgi_compat).answer_all(
        Input(), [A, b'{"inputs": "s", "stream": true}', b'{"messages": [], "stream": true}'])
    assert lines(out) == [{"generated_text": "A"}, refusal, refusal]
    assert seen == [{"inputs": "a"}]  # never generated


def test_a_record_answered_by_a_stream_anyway_is_closed_and_refused():
    closed = threading.Event()

    def chunks():
        try:
            yield "x"
        finally:
            closed.set()

    def answer(item):
        stream = chunks()
        next(stream)  # started, as a stream's first event is awaited
        return Output().add_stream_content(stream)

    out = answerer(answer).answer_all(Input(), [A, B])
    assert lines(out) == [{"error": multi_record.STREAM_REFUSED, "code": 424}] * 2 and closed.is_set()


def test_a_multiline_answer_becomes_one_line():
    def answer(item):
        return Output().add(b'{\n  "generated_text": "a\\nb"\n}') if item.get_as_json()["inputs"] == "a" \
            else Output().add("plain\ntext")

    assert lines(answerer(answer).answer_all(Input(), [A, B])) == [{"generated_text": "a\nb"}, "plain\ntext"]


def test_client_gone_ends_the_whole_body():
    def answer(item):
        raise ClientGone("gone")

    with pytest.raises(ClientGone):
        answerer(answer).answer_all(Input(), [A, B])


# --- through the rolling handler -----------------------------------------------------------------

class RefusingEngine:
    """An Engine that refuses the prompt "overload" (Overloaded) and fails any other (GenerationFailed)."""

    eos_token_ids = frozenset({2})
    max_model_len = 64
    scheduler = SimpleNamespace(max_batch_size=4)

    def tokenizer(self, text):
        return SimpleNamespace(input_ids=[9, 9] if text == "overload" else [5, 6, 7])

    def generate(self, requests):
        raise Overloaded("queue full") if tuple(requests[0].prompt_ids) == (9, 9) else GenerationFailed("boom")


def test_the_rolling_handler_answers_a_jsonlines_body_record_by_record():
    service = RollingBatchService(RefusingEngine(), max_input_len=32)
    body = (b'{"inputs": "x"}\n{"inputs": \n{"inputs": "x", "parameters": {"max_new_tokens": -1}}\n'
            b'{"inputs": "overload"}\n')
    out = service.inference(Input.from_http(body, {"Content-Type": "application/jsonlines"}, [], "req-1"))
    got = lines(out)
    assert got[0] == {"error": "boom", "code": 424}
    assert got[1]["code"] == 424 and "not valid JSON" in got[1]["error"]  # LMI's answer to that line alone
    assert got[2]["code"] == 424 and "max_new_tokens" in got[2]["error"]
    assert got[3] == {"code": 503, "type": "WlmCapacityException", "message": "queue full", "error": "queue full"}


def test_the_rolling_handler_leaves_one_record_alone():
    service = RollingBatchService(RefusingEngine(), max_input_len=32)
    out = service.inference(Input.from_http(b'{"inputs": "x"}\n', {"Content-Type": "application/jsonlines"}, [], "r"))
    assert (out.code, json.loads(out.body())) == (424, {"error": "boom", "code": 424})
