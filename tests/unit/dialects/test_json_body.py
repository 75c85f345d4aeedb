"""json_body.loads: the one JSON decoder of every route refuses what would break the server later."""

from __future__ import annotations

import json

import pytest

from lmi_serve import json_body, json_scan
from lmi_serve.json_body import MAX_DEPTH, InvalidJson, loads, nesting_depth


def test_plain_bodies_decode_as_json_does():
    body = {"inputs": "[{ not nesting }]", "parameters": {"stop": ["]]", "}}"], "n": [1, [2, [3]]]}}
    assert loads(json.dumps(body).encode()) == body
    assert loads(json.dumps(body)) == body


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert nesting_depth(b'{"a": "[[[[{{{{", "b": "\\"]]]"}') == 1
    assert nesting_depth(b'[[1], [[2]]]') == 3
    assert nesting_depth(b'"just a string"') == 0


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_000, 5_000, 100_000])
def test_deep_nesting_is_refused_before_decoding(depth):
    with pytest.raises(InvalidJson, match=f"nested {depth} levels deep"):
        loads(b'{"parameters": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")


def test_nesting_up_to_the_limit_is_accepted():
    value = loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    for _ in range(MAX_DEPTH - 1):
        value = value[0]
    assert value == []


@pytest.mark.parametrize("body", [b'{"inputs": "\\ud800"}', b'{"prompt": ["ok", "a\\udfffb"]}', b'{"\\udc00": 1}'])
def test_lone_surrogates_are_refused(body):
    with pytest.raises(InvalidJson, match="lone UTF-16 surrogate"):
        loads(body)


def test_paired_surrogates_are_one_character():
    assert loads(b'{"e": "\\ud83d\\ude00"}') == {"e": "\U0001F600"}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_json_number_literals_are_refused(literal):
    with pytest.raises(InvalidJson, match=f"{literal} is not a valid JSON value"):
        loads(f'{{"temperature": {literal}}}'.encode())


@pytest.mark.parametrize("body, reason", [(b"", "empty"), (b"  \n", "empty"), (b"\xff\xfe{}", "not valid UTF-8"),
                                          (b'{"a": 1', "not valid JSON"), (b"{'a': 1}", "not valid JSON")])
def test_malformed_bodies_say_why(body, reason):
    with pytest.raises(InvalidJson, match=reason):
        loads(body)


def test_invalid_json_is_a_value_error_for_callers_that_catch_those():
    assert issubclass(InvalidJson, ValueError)


def test_an_object_pairs_hook_sees_every_pair_and_the_rules_still_hold():
    seen = []

    def keep_pairs(pairs):
        seen.append(list(pairs))
        return dict(pairs)

    assert loads(b'{"a": 1, "a": 2, "b": {"c": 3}}', object_pairs_hook=keep_pairs) == {"a": 2, "b": {"c": 3}}
    assert seen == [[("c", 3)], [("a", 1), ("a", 2), ("b", {"c": 3})]]
    with pytest.raises(InvalidJson, match="lone UTF-16 surrogate"):
        loads(b'{"a": {"b": "\\ud800"}}', object_pairs_hook=dict)
    with pytest.raises(InvalidJson, match="nested 3 levels deep"):
        loads(b'{"a": {"b": {}}}', max_depth=2, object_pairs_hook=dict)


def test_keys_are_counted_outside_strings_whatever_the_chunks():
    body = b'{"a": 1, "b:c": [{"d": "x:y"}, ":"], "e\\":": {}}'
    assert json_scan.scan(body).keys == 4
    assert all(json_scan.scan(body, chunk_size=size).keys == 4 for size in (1, 2, 3, 7))


def test_more_keys_than_the_route_takes_are_refused_before_decoding(monkeypatch):
    body = ("{" + ",".join(f'"k{i}":{{"v":{i}}}' for i in range(10)) + "}").encode()
    assert len(json_body.loads(body, max_keys=20)) == 10  # 10 outer keys and 10 inner: at the cap
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(json_body.InvalidJson, match="21 object keys; this route takes at most 20"):
        json_body.loads(body[:-1] + b',"one":1}', max_keys=20)


def test_a_scan_with_a_key_cap_stops_once_over_it():
    body = b"[" + b'{"k":0},' * 1000 + b"[[[[[[0]]]]]]]"
    assert json_scan.scan(body).depth == 7
    stopped = json_scan.scan(body, chunk_size=64, max_keys=10)
    assert 10 < stopped.keys < 1000 and stopped.depth == 2  # the deep tail was never read
    assert json_scan.scan(body, chunk_size=64, max_keys=5000) == json_scan.scan(body)


def test_values_are_counted_by_their_commas_outside_strings_whatever_the_chunks():
    """Every array or object of n values has n - 1 commas, so a body has commas + 1 values that are
    no container of others (numbers, strings, literals, empty containers)."""
    body = b'{"a": [1, "b,c", {"d": [2, 3], "e": {}}], "f,": ","}'  # 1 "b,c" 2 3 {} ","
    assert json_scan.scan(body).commas + 1 == 6
    assert all(json_scan.scan(body, chunk_size=size).commas == 5 for size in (1, 2, 3, 7))


def test_more_values_than_the_route_takes_are_refused_before_decoding(monkeypatch):
    rows = b"[" + b",".join(b"[%d, %d]" % (i, -i) for i in range(10)) + b"]"  # 20 values
    assert len(json_body.loads(rows, max_values=20)) == 10
    flat = b'{"data": [' + b", ".join(b"7" for _ in range(200_000)) + b"]}"  # a long run for json_bulk
    assert json_scan.scan(flat).flat_runs and len(json_body.loads(flat, max_values=200_000)["data"]) == 200_000
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("decoded"))
    monkeypatch.setattr(json_body.json_bulk, "loads", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(json_body.InvalidJson, match="at least 21 values in its arrays and objects; "
                                                    "this route takes at most 20"):
        json_body.loads(rows[:-1] + b", 1]", max_values=20)
    with pytest.raises(json_body.InvalidJson, match="this route takes at most 199,999"):
        json_body.loads(flat, max_values=199_999)


def test_a_scan_with_a_comma_cap_stops_once_over_it():
    body = b"[" + b"0," * 1000 + b"[[[[[[0]]]]]]]"
    stopped = json_scan.scan(body, chunk_size=64, max_commas=10)
    assert 10 < stopped.commas < 1000 and stopped.depth == 1  # the deep tail was never read
    assert json_scan.scan(body, chunk_size=64, max_commas=5000) == json_scan.scan(body, chunk_size=64)
