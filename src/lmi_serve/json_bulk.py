"""Piecewise decoding of the long flat arrays of numbers a body may hold (a tensor's data, token ids).

`json.loads` is one C call that holds the GIL until the whole value is built: an array of 33 million
numbers (a 64 MiB body) held the worker's other requests ~2 s, and orjson and msgspec hold the GIL
while they decode too (measured, benchmarks/journal/2026-12.md). The body scan marks the stretches
of whole chunks that hold only numbers, commas and blanks inside a container (`BodyScan.flat_runs`).
Each long one is cut out at its first and last comma and replaced by `NaN`, which no accepted body
holds (json_body refuses it): decoding the rest, the i-th `NaN` becomes the i-th stretch's marker and
any further one is refused as before. Each stretch is decoded in pieces of PIECE bytes, one short call
each, so the worker's other threads run between pieces; then its values take the marker's place in
its array. The result is what `json.loads`
gives: the pieces are the same elements, decoded by the same decoder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

# Bytes decoded per call: ~3 ms with the GIL held on a slow core. Small, because a thread that wants
# the GIL (the engine's, between two torch ops of a step) waits for the whole call: with 1 MiB pieces
# (~50 ms) a running stream's longest gap was still 2-4.5 s beside a 64 MiB array (bench_body_scan).
PIECE = 64 * 1024
MIN_RUN = 1 << 20  # a shorter stretch is decoded with the rest


class _Marker:
    """Where the `index`-th stretch goes."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _cut(raw: bytes, runs: tuple[tuple[int, int], ...]) -> tuple[bytes, list[tuple[int, int]]]:
    """The body with each long run's whole elements replaced by `NaN`; their byte ranges in order."""
    parts, regions, pos = [], [], 0
    for start, end in runs:
        first, last = raw.find(b",", start, end), raw.rfind(b",", start, end)
        if end - start < MIN_RUN or first < 0 or last <= first + 1:
            continue
        parts += [raw[pos:first + 1], b"NaN"]
        regions.append((first + 1, last))
        pos = last
    parts.append(raw[pos:])
    return b"".join(parts), regions


def _markers(count: int, parse_constant: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse_constant for the cut body: the first `count` NaNs are the markers, in order."""
    given = iter(range(count))

    def constant(name: str) -> Any:
        index = next(given, None) if name == "NaN" else None
        return _Marker(index) if index is not None else parse_constant(name)

    return constant


def _pieces(raw: bytes, start: int, end: int, parse_constant: Callable[[str], Any]) -> Iterator[list]:
    """The comma-separated values of raw[start:end], decoded a piece at a time."""
    while start < end:
        stop = end if end - start <= PIECE else raw.rfind(b",", start, start + PIECE)
        stop = end if stop <= start else stop
        piece = json.loads("[" + raw[start:stop].decode("ascii") + "]", parse_constant=parse_constant)
        if not piece:  # only blanks between two commas
            raise ValueError("Expecting value between two commas")
        yield piece
        start = stop + 1
        time.sleep(0)  # hand the GIL to a waiting thread now, not at the next switch interval


def _places(value: Any, count: int) -> list[tuple[list, int]]:
    """(the list holding it, its index) of each marker, in marker order; a marker that is not an
    array element (the stretch was inside an object: not JSON) is refused as json.loads would."""
    places: dict[int, tuple[list, int]] = {}
    pending = [value]
    while pending:
        item = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend(child for child in children if isinstance(child, (dict, list)))
        if isinstance(item, list):
            places.update((x.index, (item, i)) for i, x in enumerate(item) if isinstance(x, _Marker))
    if len(places) != count:
        raise ValueError("Expecting property name enclosed in double quotes")
    return [places[i] for i in range(count)]


def loads(raw: bytes, runs: tuple[tuple[int, int], ...], parse_constant: Callable[[str], Any],
          object_pairs_hook: Callable | None = None) -> Any:
    """`raw` decoded as `json.loads` would; its long runs piecewise. Raises what json.loads raises."""
    outline, regions = _cut(raw, runs)
    value = json.loads(outline.decode("utf-8"), parse_constant=_markers(len(regions), parse_constant),
                       object_pairs_hook=object_pairs_hook)
    if isinstance(value, _Marker):  # (cannot happen: a stretch lies inside a container)
        raise ValueError("Expecting value")
    places = _places(value, len(regions))
    # Last stretch first: filling one shifts the later elements of its list, never the earlier ones.
    # Each piece goes into place as it comes (no list of every value copied in at the end, which held
    # the GIL 0.3 s for 33 million).
    for (holder, index), span in reversed(list(zip(places, regions))):
        del holder[index]
        for piece in _pieces(raw, *span, parse_constant):
            holder[index:index] = piece
            index += len(piece)
    return value
