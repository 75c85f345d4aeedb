"""parse_batch: per-member parsing, so one bad request of a dynamic batch fails alone."""

from __future__ import annotations

import json

from lmi_serve.handler_api import Input
from lmi_serve.handler_utils import parse_batch, read_payload


def member(body: bytes, content_type: str = "application/json") -> Input:
    return Input.from_http(body, {"Content-Type": content_type}, [], "rid")


def parse_value(item: Input) -> int:
    value = read_payload(item)["value"]
    if value < 0:
        raise ValueError("value must be >= 0")
    return value


def test_bad_members_get_their_own_424_and_good_ones_are_parsed():
    batch = Input.batch_of([member(b'{"value": 1}'), member(b'{"value": -1}'), member(b"not json"),
                            member(b'{"value": 3}')])
    output, parsed = parse_batch(batch, parse_value)
    assert parsed == {0: 1, 3: 3}
    outputs = output.get_batch_outputs(4)
    assert [o.code for o in outputs[1:3]] == [424, 424]
    assert json.loads(outputs[1].body())["error"] == "value must be >= 0"
    assert "not valid JSON" in json.loads(outputs[2].body())["error"]


def test_a_single_bad_request_becomes_the_whole_error_output():
    output, parsed = parse_batch(member(b"{}"), parse_value)
    assert parsed == {}
    assert output.code == 424
    assert json.loads(output.body()) == {"code": 424, "message": "invoke handler failure", "error": "'value'"}


def test_text_plain_body_is_read_as_text():
    assert read_payload(member("héllo".encode(), "text/plain; charset=utf-8")) == "héllo"
    assert read_payload(member(b'{"a": 1}')) == {"a": 1}
