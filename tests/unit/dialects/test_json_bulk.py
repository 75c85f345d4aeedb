"""json_bulk: long arrays of numbers decoded a piece at a time give what json.loads gives, and
refuse what it refuses."""

from __future__ import annotations

import json

import pytest

from lmi_serve import json_body, json_bulk, json_scan


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(json_bulk, "PIECE", 50)
    monkeypatch.setattr(json_bulk, "MIN_RUN", 100)


def decoded(body: bytes):
    facts = json_scan.scan(body, chunk_size=64)
    assert facts.flat_runs, "the body has no long run: the test would not reach json_bulk"
    return json_body.loads(body, scanned=facts)


NUMBERS = ", ".join(str(i * 7 % 1000 - 500) + (".5" if i % 3 == 0 else "") for i in range(400))


@pytest.mark.parametrize("body", [
    f"[{NUMBERS}]",
    f'{{"model": "m", "input": [[1, 2], [{NUMBERS}], [3]], "tail": {{"a": [{NUMBERS}]}}}}',
    f'{{"inputs": [{{"name": "x", "data": [{NUMBERS}, 123456789012345678901234567890, -1e5]}}]}}',
])
def test_the_result_is_json_loads(body):
    assert decoded(body.encode()) == json.loads(body)


@pytest.mark.parametrize("bad", [b"[" + NUMBERS.encode() + b", , 1]", b"[" + NUMBERS.encode() + b", NaN, 1]",
                                 b'{"a": 1, ' + NUMBERS.encode() + b"}", b"[" + NUMBERS.encode() + b", 1 2]"])
def test_what_json_refuses_is_refused(bad):
    with pytest.raises(json_body.InvalidJson):
        decoded(bad)


def test_a_nan_the_client_sent_is_refused_not_taken_for_a_stretch():
    """The cut body marks each stretch with NaN: one more NaN, before or after it, is the client's."""
    for body in (b"[NaN, " + NUMBERS.encode() + b"]", b"[" + NUMBERS.encode() + b", 1, NaN]"):
        with pytest.raises(json_body.InvalidJson, match="NaN is not a valid JSON value"):
            decoded(body)
