"""json_scan.scan: one linear pass finds what the body's checks need, whatever the chunking."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_serve.json_scan import CHUNK, scan


def reference(data: bytes, outline_depth: int) -> tuple[int, bytes, int, int]:
    """Depth, outline, and the colons and commas outside strings, by walking the bytes one by one:
    slow, obviously right."""
    depth = level = keys = commas = 0
    in_string = escaped = False
    kept = bytearray()
    for byte in data:
        keys += not in_string and byte == ord(":")
        commas += not in_string and byte == ord(",")
        own = level
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            level += 1
            own = level
        elif byte in b"]}":
            level -= 1
        depth = max(depth, level)
        if own <= outline_depth:
            kept.append(byte)
    return depth, bytes(kept), keys, commas


# Strings full of what confuses a scan: brackets, quotes, runs of backslashes, \u escapes.
tricky_text = st.lists(st.sampled_from(list('[]{}"\\ux') + ["\\\\", '\\"', "\U0001F600", "\ud800"]),
                       max_size=12).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii=st.booleans(), chunk_size=st.sampled_from([1, 2, 3, 5, 64, CHUNK]),
       outline_depth=st.integers(0, 3))
def test_depth_and_outline_match_a_byte_by_byte_walk_for_any_chunking(value, ascii, chunk_size, outline_depth):
    data = json.dumps(value, ensure_ascii=ascii).encode("utf-8", "surrogatepass")
    found = scan(data, outline_depth=outline_depth, chunk_size=chunk_size)
    assert (found.depth, found.outline, found.keys, found.commas) == reference(data, outline_depth)
    assert scan(data, chunk_size=chunk_size).commas == found.commas  # the fast paths count the same
    assert (found.of_outline().keys, found.of_outline().commas) == reference(found.outline, outline_depth)[2:]


@pytest.mark.parametrize("chunk_size", [1, 2, 7, CHUNK])
def test_a_run_of_backslashes_across_chunks_keeps_its_parity(chunk_size):
    # the quote after an even run closes the string; after an odd run it is escaped
    assert scan(b'["' + b"\\" * 10 + b'"] [[', chunk_size=chunk_size).depth == 2
    assert scan(b'["' + b"\\" * 9 + b'"] [[', chunk_size=chunk_size).depth == 1
    assert scan(b'["' + b"\\" * 9 + b'""] [[', chunk_size=chunk_size).depth == 2


@pytest.mark.parametrize("body, hinted", [(b'"\\ud800"', True), (b'"\\uDFFF"', True), (b'"\\ud83d\\ude00"', True),
                                          (b'"\\u0041 ud800"', False), (b'"plain"', False)])
def test_the_surrogate_hint_finds_any_surrogate_escape(body, hinted):
    for chunk_size in (1, 3, CHUNK):
        assert scan(b"[" + body + b"]", chunk_size=chunk_size).surrogate_escape is hinted


def test_the_outline_scan_is_known_without_scanning_again():
    found = scan(b'{"ready": [[[1]]], "x": "\\ud800"}', outline_depth=2)
    assert found.outline == b'{"ready": [], "x": "\\ud800"}'
    assert (found.of_outline().depth, found.of_outline().surrogate_escape) == (2, True)
    with pytest.raises(ValueError):
        scan(b"[]").of_outline()


def _peak_extra_bytes(body: bytes) -> int:
    tracemalloc.start()
    try:
        scan(body)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", ["string", "escapes", "brackets"])
def test_extra_memory_is_bounded_by_the_chunk_not_the_body(shape):
    # A regular expression stripping strings took ~120 bytes per byte of a long string.
    make = {"string": lambda n: b'{"a": "' + b"x" * n + b'"}', "escapes": lambda n: b'["' + b'\\"' * (n // 2) + b'"]',
            "brackets": lambda n: b"[" * (n // 2) + b"]" * (n // 2)}[shape]
    small, large = (_peak_extra_bytes(make(size)) for size in (2 * CHUNK, 64 * CHUNK))
    assert large <= 40 * CHUNK
    assert large < 2 * small + CHUNK  # 32 times the body, about the same memory


def test_chunk_size_is_bounded():
    with pytest.raises(ValueError):
        scan(b"[]", chunk_size=CHUNK + 1)
