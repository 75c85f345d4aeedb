"""Behaviour of the DJL-compatible handler contract (Input / Output / PairList)."""

from __future__ import annotations

import datetime
import io
import json
import logging
import types

import pytest

from lmi_serve.handler_api import (
    Input,
    Output,
    PairList,
    find_annotated,
    input_formatter,
    output_formatter,
)


# ---------------------------------------------------------------- PairList


def test_pairlist_keeps_order_and_duplicates():
    pl = PairList()
    pl.add("a", 1)
    pl.add("b", 2)
    pl.add("a", 3)
    assert pl.keys() == ["a", "b", "a"]
    assert pl.values() == [1, 2, 3]
    assert pl.items() == [("a", 1), ("b", 2), ("a", 3)]
    assert list(pl) == [("a", 1), ("b", 2), ("a", 3)]
    assert pl.get("a") == 1
    assert pl.get("missing") is None
    assert pl.key_at(1) == "b" and pl.value_at(2) == 3
    assert pl.size() == 3 and len(pl) == 3
    assert not pl.is_empty()
    pl.remove("a")
    assert pl.items() == [("b", 2)]
    pl.remove("b")
    assert pl.is_empty() and len(pl) == 0


# ---------------------------------------------------------------- Input basics


def _http_input(body=b'{"inputs": "hi"}', headers=None, query=None):
    headers = {"Content-Type": "application/json"} if headers is None else headers
    return Input.from_http(body, headers, query or {}, "req-1")


def test_from_http_copies_headers_and_request_id():
    inp = _http_input(headers={"Content-Type": "application/json", "X-Foo": "bar"})
    assert inp.get_properties()["X-Foo"] == "bar"
    assert inp.get_properties()["Content-Type"] == "application/json"
    assert inp.get_property("requestId") == "req-1"
    assert inp.get_function_name() == "handle"
    assert inp.content.get("data") == b'{"inputs": "hi"}'


def test_get_property_is_case_insensitive():
    inp = _http_input(headers={"Content-Type": "text/plain"})
    assert inp.get_property("content-type") == "text/plain"
    assert inp.get_property("CONTENT-TYPE") == "text/plain"
    assert inp.get_property("absent") is None
    inp.add_property("Foo", "1")
    assert inp.get_property("foo") == "1"


def test_custom_attributes_header_split_into_properties():
    inp = _http_input(
        headers={"x-amzn-sagemaker-custom-attributes": " k1 = v1 ;k2=v2=x; junk ;"}
    )
    props = inp.get_properties()
    assert props["k1"] == "v1"
    assert props["k2"] == "v2=x"
    assert "junk" not in props and "" not in props


def test_query_params_become_content_entries():
    inp = _http_input(query={"temperature": "0.5", "name": "é"})
    assert inp.content.keys() == ["data", "temperature", "name"]
    assert inp.get_as_bytes("temperature") == b"0.5"
    assert inp.get_as_string("name") == "é"
    inp2 = _http_input(query=[("a", "1"), ("a", "2")])
    assert inp2.content.items()[1:] == [("a", b"1"), ("a", b"2")]


def test_get_as_bytes_defaults_and_missing_key():
    inp = Input()
    assert inp.is_empty()
    assert inp.get_as_bytes() == b""
    inp.content.add("first", b"1")
    assert inp.get_as_bytes() == b"1"  # no data entry -> first entry
    inp.content.add("data", b"2")
    assert inp.get_as_bytes() == b"2"  # data entry preferred
    assert not inp.is_empty()
    with pytest.raises(KeyError, match="nope"):
        inp.get_as_bytes("nope")


def test_get_as_json_and_errors():
    assert _http_input().get_as_json() == {"inputs": "hi"}
    with pytest.raises(ValueError, match=r"^Input is not valid JSON: Expecting"):
        _http_input(body=b"{not json").get_as_json()
    with pytest.raises(ValueError, match="Input is not valid JSON"):
        _http_input(body=b"").get_as_json()
    with pytest.raises(ValueError, match="Input is not valid JSON"):
        _http_input(body=b"   ").get_as_json()


def test_get_as_numpy_roundtrip():
    np = pytest.importorskip("numpy")
    buf = io.BytesIO()
    np.save(buf, np.arange(6, dtype=np.float32).reshape(2, 3))
    inp = Input.from_http(buf.getvalue(), {"Content-Type": "tensor/npz"}, {}, "r")
    arr = inp.get_as_numpy()
    assert arr.shape == (2, 3) and arr.dtype == np.float32
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    "content_type,body,expected",
    [
        ("application/json", b'{"a": 1}', {"a": 1}),
        ("Application/JSON; charset=utf-8", b"[1, 2]", [1, 2]),
        ("text/plain", b'{"a": 1}', '{"a": 1}'),
        (None, b'{"a": 1}', {"a": 1}),
        (None, b"plain words", "plain words"),
        ("application/octet-stream", b'{"a": 1}', b'{"a": 1}'),
    ],
)
def test_get_data_dispatch(content_type, body, expected):
    headers = {} if content_type is None else {"content-type": content_type}
    got = Input.from_http(body, headers, {}, "r").get_data()
    assert got == expected
    assert type(got) is type(expected)


def test_get_data_json_content_type_rejects_bad_json():
    with pytest.raises(ValueError, match="Input is not valid JSON"):
        Input.from_http(b"oops", {"Content-Type": "application/json"}, {}, "r").get_data()


# ---------------------------------------------------------------- batches


def test_non_batch_get_batches_is_self():
    inp = _http_input()
    assert not inp.is_batch()
    assert inp.get_batches() == [inp]


def test_batch_of_uses_three_digit_keys_and_round_trips():
    members = [
        Input.from_http(f'{{"i": {i}}}'.encode(), {"Content-Type": "application/json"}, {"q": str(i)}, f"r{i}")
        for i in range(12)
    ]
    batch = Input.batch_of(members)
    assert batch.is_batch()
    assert batch.get_property("batch_size") == "12"
    assert batch.content.get("batch_000.data") == b'{"i": 0}'
    assert batch.content.get("batch_011.q") == b"11"
    assert batch.properties["batch_003.requestId"] == "r3"
    assert batch.properties["batch_000.Content-Type"] == "application/json"
    assert "batch_0.data" not in batch.content.keys()

    back = batch.get_batches()
    assert len(back) == 12
    for orig, got in zip(members, back):
        assert got.properties == orig.properties
        assert got.content.items() == orig.content.items()
        assert not got.is_batch()
    assert back[7].get_data() == {"i": 7}


def test_get_batches_shares_global_properties_except_batch_size():
    batch = Input.batch_of([Input(content=PairList([("data", b"a")])), Input(content=PairList([("data", b"b")]))])
    batch.add_property("X-Global", "g")
    a, b = batch.get_batches()
    assert a.properties == {"X-Global": "g"} and b.properties == {"X-Global": "g"}
    assert a.get_as_bytes() == b"a" and b.get_as_bytes() == b"b"


# ---------------------------------------------------------------- Output


def test_output_defaults_and_chaining():
    out = Output()
    assert (out.code, out.message) == (200, "OK")
    assert out.body() == b"" and out.content_type() is None
    assert out.add_property("X-A", "1") is out
    assert out.add("x") is out
    out.set_code(201)
    out.set_message("Created")
    assert (out.code, out.message) == (201, "Created")


def test_output_add_encodings_and_content_type():
    out = Output().add("héllo")
    assert out.body() == "héllo".encode("utf-8")
    assert out.content_type() is None  # strings do not force a content type

    out = Output().add(bytearray(b"\x00\x01"))
    assert out.body() == b"\x00\x01" and out.content_type() is None

    out = Output().add({"text": "é", "n": [1, 2]})
    assert out.body() == '{"text": "é", "n": [1, 2]}'.encode("utf-8")
    assert out.properties["Content-Type"] == "application/json"

    out = Output().add_property("content-type", "text/csv").add([1])
    assert out.content_type() == "text/csv"
    assert "Content-Type" not in out.properties

    with pytest.raises(ValueError):
        Output().add({"x": float("nan")})


def test_output_add_json_default_for_numpy_and_datetime():
    np = pytest.importorskip("numpy")
    when = datetime.datetime(2024, 1, 2, 3, 4, 5)
    out = Output().add({"a": np.arange(3), "s": np.float32(1.5), "t": when})
    assert json.loads(out.body()) == {"a": [0, 1, 2], "s": 1.5, "t": "2024-01-02T03:04:05"}


def test_output_add_keys_and_batch_index():
    out = Output()
    out.add("a").add("b", key="extra").add("c", batch_index=3).add("d", key="k", batch_index=0)
    assert out.content.keys() == ["data", "extra", "batch_3.data", "batch_0.k"]
    assert out.body() == b"a"
    only_other = Output().add("z", key="other")
    assert only_other.body() == b"z"


def test_add_as_json_encodes_strings():
    out = Output().add_as_json("hi", batch_index=1)
    assert out.content.items() == [("batch_1.data", b'"hi"')]
    assert out.content_type() == "application/json"


def test_error_body():
    out = Output().add("partial").add_property("Content-Type", "text/plain")
    assert out.error("boom") is out
    assert (out.code, out.message) == (424, "invoke handler failure")
    assert out.content_type() == "application/json"
    assert json.loads(out.body()) == {"code": 424, "message": "invoke handler failure", "error": "boom"}
    assert out.content.keys() == ["data"]
    out.error("bad input", code=400, message="Bad Request")
    assert json.loads(out.body()) == {"code": 400, "message": "Bad Request", "error": "bad input"}
    assert out.code == 400


# ---------------------------------------------------------------- batch outputs


def test_get_batch_outputs_splits_content_and_properties():
    out = Output().add_property("X-Shared", "s")
    out.add({"r": 0}, batch_index=0)
    out.add("failed item", batch_index=1)
    out.add_property("batch_1.code", "424").add_property("batch_1.message", "bad item")
    out.add_property("batch_001.X-Item", "one")
    out.add("zero-padded", key="data", batch_index=None)  # un-prefixed content is ignored
    out.content.add("batch_002.data", b"two")
    members = out.get_batch_outputs(3)
    assert len(members) == 3
    m0, m1, m2 = members
    assert m0.code == 200 and json.loads(m0.body()) == {"r": 0}
    assert m0.content.keys() == ["data"]
    assert m1.code == 424 and m1.message == "bad item" and m1.body() == b"failed item"
    assert m1.properties["X-Item"] == "one"
    assert "X-Item" not in m0.properties
    assert "batch_1.code" not in m1.properties and "code" not in m1.properties
    assert m2.body() == b"two"
    for m in members:
        assert m.properties["X-Shared"] == "s"
        assert m.properties["Content-Type"] == "application/json"


def test_get_batch_outputs_missing_item_is_500():
    out = Output().add("a", batch_index=0).add("c", batch_index=2)
    members = out.get_batch_outputs(3)
    assert [m.code for m in members] == [200, 500, 200]
    err = json.loads(members[1].body())
    assert err["code"] == 500
    assert "no output" in err["error"] and "1" in err["error"]
    assert members[1].content_type() == "application/json"


def test_get_batch_outputs_whole_batch_failure_copied():
    out = Output().error("model exploded", code=503, message="Service Unavailable")
    out.add_property("X-Trace", "t")
    members = out.get_batch_outputs(2)
    assert len(members) == 2
    for m in members:
        assert m is not out
        assert (m.code, m.message) == (503, "Service Unavailable")
        assert json.loads(m.body())["error"] == "model exploded"
        assert m.properties["X-Trace"] == "t"
    members[0].properties["X-Trace"] = "changed"
    assert members[1].properties["X-Trace"] == "t"


# ---------------------------------------------------------------- streaming


def test_stream_default_formatter():
    out = Output()
    assert not out.is_stream()
    assert list(out.iter_stream_chunks()) == []
    out.add_stream_content(iter(["a", "b"]))
    assert out.is_stream()
    chunks = list(out.iter_stream_chunks())
    assert chunks == [b'{"outputs": "a"}\n', b'{"outputs": "b"}\n']


def test_stream_custom_formatter_str_and_bytes():
    out = Output().add_stream_content([1, 2, 3], output_formatter=lambda x: f"tok{x}" if x != 2 else b"raw")
    assert list(out.iter_stream_chunks()) == [b"tok1", b"raw", b"tok3"]


def test_stream_exception_yields_final_error_line(caplog):
    def gen():
        yield "first"
        raise RuntimeError("generation died")

    out = Output().add_stream_content(gen())
    with caplog.at_level(logging.ERROR):
        chunks = list(out.iter_stream_chunks())  # must not raise
    assert chunks[0] == b'{"outputs": "first"}\n'
    assert len(chunks) == 2
    assert chunks[1].endswith(b"\n")
    assert json.loads(chunks[1]) == {"code": 424, "error": "generation died"}


def test_finalizers_run_and_swallow_errors(caplog):
    calls = []
    out = Output()

    def bad():
        raise RuntimeError("cleanup failed")

    assert out.finalize(calls.append, "one") is out
    out.finalize(bad)
    out.finalize(lambda a, b: calls.append(a + b), 2, 3)
    with caplog.at_level(logging.ERROR):
        out.run_finalizers()
    assert calls == ["one", 5]
    assert "cleanup failed" in caplog.text
    out.run_finalizers()  # already run: no double cleanup
    assert calls == ["one", 5]


# ---------------------------------------------------------------- decorators


def test_formatter_decorators_and_find_annotated():
    def plain(x):
        return x

    @input_formatter
    def parse(x):
        return x

    @output_formatter
    def render(x):
        return x

    assert parse.is_input_formatter is True and parse(1) == 1
    assert render.is_output_formatter is True
    module = types.ModuleType("fake_model")
    module.plain = plain
    module.parse = parse
    module.render = render
    assert find_annotated(module, "is_input_formatter") is parse
    assert find_annotated(module, "is_output_formatter") is render
    assert find_annotated(types.ModuleType("empty"), "is_input_formatter") is None
    module2 = types.ModuleType("m2")
    module2.plain = plain
    assert find_annotated(module2, "is_output_formatter") is None
