"""One pass over a JSON body before it is decoded: nesting depth, surrogate escapes, the number
of object keys and of commas, and (for Triton's repository index) the body's outer levels. Linear in time, small and bounded in memory.

The body is read in fixed-size chunks, each vectorised with numpy, carrying three facts from one
chunk to the next: whether the scan is inside a string, how many backslashes ended the chunk (an
odd run escapes the next byte), and the nesting level. Per chunk:
- a byte is escaped when an odd run of backslashes comes right before it;
- an unescaped `"` opens or closes a string, so the parity of their running count says which
  bytes lie inside strings (brackets there do not count);
- the running sum of +1 per `[`/`{` and -1 per `]`/`}` outside strings is the nesting level;
- each `:` outside strings is one object key, and each `,` outside strings separates two values
  of an array or object (json_body refuses a body of more keys or values than a route can use
  before the decoder builds millions of them with the GIL held).
A regular expression stripping strings (the former way) backtracks per character: a 64 MiB string
took 7.8 GiB and 6-20 s with the GIL held. Here the extra memory is a few times `CHUNK`, whatever
the body, and numpy releases the GIL inside each step while other threads run between chunks.

Bytes that are not JSON (a backslash outside a string, a string never closed) are scanned all the
same; the decoder refuses such a body afterwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

CHUNK = 256 * 1024  # bytes per step: ~20 bytes of scratch per byte, so a few MiB whatever the body

_QUOTE, _BACKSLASH, _COLON, _COMMA = ord('"'), ord("\\"), ord(":"), ord(",")
_STEP = np.zeros(256, dtype=np.int8)  # byte -> +1 opens a level, -1 closes one
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_POSITIONS = np.arange(CHUNK, dtype=np.int32)
# A \uD800-\uDFFF escape, paired or not: decoding then looks for lone ones. Only a hint (an escaped
# backslash before "ud800" matches too), so it needs no escape parity.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_TAIL = 5  # bytes of the next chunk the pattern may reach into


@dataclass(frozen=True)
class BodyScan:
    """What one pass found. `outline` is the body with everything nested deeper than the
    requested `outline_depth` removed (`[[[1]]]` at depth 1 reads `[]`), or None if not requested."""

    depth: int
    surrogate_escape: bool
    outline: bytes | None = None
    outline_depth: int | None = None
    keys: int = 0  # object keys in the whole body (colons outside strings)
    # commas outside strings: an array or object of n values has n - 1, so a body with any holds at
    # least commas + 1 values in its arrays and objects
    commas: int = 0
    # (start, end) byte ranges of whole chunks with no string and no bracket inside an array or
    # object: a long flat array's numbers, which json_bulk decodes piecewise
    flat_runs: tuple[tuple[int, int], ...] = ()
    outline_keys: int = 0  # the keys and commas of `outline` alone
    outline_commas: int = 0

    def of_outline(self) -> "BodyScan":
        """The scan of `outline` itself, known without scanning it again (the surrogate hint is
        the body's: a hint may say yes when the answer is no)."""
        if self.outline is None or self.outline_depth is None:
            raise ValueError("this scan kept no outline")
        return BodyScan(min(self.depth, self.outline_depth), self.surrogate_escape, keys=self.outline_keys,
                        commas=self.outline_commas)  # no runs


class _Carry:
    """The state one chunk hands to the next."""

    __slots__ = ("in_string", "backslashes", "level", "deepest", "keys", "commas", "outline_keys", "outline_commas",
                 "flat")

    def __init__(self) -> None:
        self.in_string = False
        self.backslashes = 0  # length of the run of backslashes that ended the previous chunk
        self.level = 0
        self.deepest = 0
        self.keys = 0
        self.commas = 0
        self.outline_keys = 0
        self.outline_commas = 0
        self.flat = False  # the last chunk had no string and no bracket


def _escaped(codes: np.ndarray, carried_backslashes: int) -> tuple[np.ndarray, int]:
    """Per byte, whether an odd run of backslashes precedes it; and the run ending the chunk."""
    positions = _POSITIONS[:codes.size]
    is_backslash = codes == _BACKSLASH
    # index of the last byte that is no backslash, at or before each position (the carried run
    # sits just before the chunk, at -carried .. -1)
    last_other = np.maximum.accumulate(np.where(is_backslash, np.int32(-1 - carried_backslashes), positions))
    before = np.empty_like(last_other)
    before[0] = -1 - carried_backslashes
    before[1:] = last_other[:-1]
    run_before = positions - 1 - before
    return (run_before & 1).astype(bool), int(codes.size - 1 - last_other[-1])


def _carry_trailing_backslashes(chunk: bytes, has_backslash: bool, carry: _Carry) -> None:
    trailing = len(chunk) - len(chunk.rstrip(b"\\")) if has_backslash else 0
    carry.backslashes = carry.backslashes + trailing if trailing == len(chunk) else trailing


def _has_bracket(chunk: bytes) -> bool:
    return b"[" in chunk or b"]" in chunk or b"{" in chunk or b"}" in chunk


def _scan_chunk(chunk: bytes, carry: _Carry, outline_depth: int | None) -> bytes | None:
    """Advance `carry` over `chunk`; return the chunk's bytes at or above `outline_depth` if asked."""
    has_quote = _QUOTE in chunk
    has_backslash = _BACKSLASH in chunk
    carry.flat = False
    if not has_quote and carry.in_string and outline_depth is None:  # all inside one string
        _carry_trailing_backslashes(chunk, has_backslash, carry)
        return None
    if not has_quote and not carry.in_string and outline_depth is None and not _has_bracket(chunk):
        # outside strings and no level changes (a long array of numbers): nothing for numpy to do
        _carry_trailing_backslashes(chunk, has_backslash, carry)
        carry.keys += chunk.count(b":")
        carry.commas += chunk.count(b",")
        carry.deepest = max(carry.deepest, carry.level)
        carry.flat = True
        return None
    codes = np.frombuffer(chunk, dtype=np.uint8)
    steps = _STEP[codes]
    outside = None  # every byte is outside strings
    if has_quote or carry.in_string:
        quotes = codes == _QUOTE
        if has_backslash or carry.backslashes:
            escaped, carry.backslashes = _escaped(codes, carry.backslashes)
            quotes &= ~escaped
        else:
            carry.backslashes = 0
        inside = np.cumsum(quotes, dtype=np.int32)
        inside += carry.in_string
        inside &= 1
        carry.in_string = bool(inside[-1])
        outside = inside == 0
        steps *= outside
        carry.keys += int(np.count_nonzero((codes == _COLON) & outside))
        carry.commas += int(np.count_nonzero((codes == _COMMA) & outside))
    else:  # no string starts, ends or runs here: every byte is outside strings
        _carry_trailing_backslashes(chunk, has_backslash, carry)
        carry.keys += chunk.count(b":")
        carry.commas += chunk.count(b",")
    levels = np.cumsum(steps, dtype=np.int32)
    levels += carry.level
    carry.deepest = max(carry.deepest, int(levels.max()))
    carry.level = int(levels[-1])
    if outline_depth is None:
        return None
    levels += steps < 0  # a closing bracket belongs to the level it closes
    kept = levels <= outline_depth
    if outside is not None:
        kept_outside = kept & outside
        carry.outline_keys += int(np.count_nonzero((codes == _COLON) & kept_outside))
        carry.outline_commas += int(np.count_nonzero((codes == _COMMA) & kept_outside))
    else:
        carry.outline_keys += int(np.count_nonzero((codes == _COLON) & kept))
        carry.outline_commas += int(np.count_nonzero((codes == _COMMA) & kept))
    return codes[kept].tobytes()


def scan(data: bytes, outline_depth: int | None = None, *, chunk_size: int = CHUNK,
         max_keys: int | None = None, max_commas: int | None = None) -> BodyScan:
    """One pass over `data` (see the module docstring); `outline_depth` also keeps the outline.
    `chunk_size` (at most CHUNK) only changes where chunks end, never the result. With `max_keys`
    (`max_commas`), the pass stops at the chunk where the keys (commas) exceed it: the body will be
    refused for that, and the rest need not be read (its depth and outline are then those of the
    part read)."""
    if not 0 < chunk_size <= CHUNK:
        raise ValueError(f"chunk_size must be 1 to {CHUNK}")
    carry = _Carry()
    outline = bytearray() if outline_depth is not None else None
    surrogate_escape = False
    runs: list[tuple[int, int]] = []
    view = memoryview(data).cast("B")
    for start in range(0, len(view), chunk_size):
        chunk = bytes(view[start:start + chunk_size])
        kept = _scan_chunk(chunk, carry, outline_depth)
        if outline is not None:
            outline += kept
        if not surrogate_escape:
            reach = view[start:start + chunk_size + _SURROGATE_ESCAPE_TAIL]
            surrogate_escape = _SURROGATE_ESCAPE.search(reach) is not None
        if carry.flat and carry.level > 0:
            _extend_runs(runs, start, start + len(chunk))
        if (max_keys is not None and carry.keys > max_keys) or (max_commas is not None and carry.commas > max_commas):
            break
    if outline is None:
        return BodyScan(carry.deepest, surrogate_escape, keys=carry.keys, commas=carry.commas, flat_runs=tuple(runs))
    return BodyScan(carry.deepest, surrogate_escape, bytes(outline), outline_depth, carry.keys, carry.commas,
                    outline_keys=carry.outline_keys, outline_commas=carry.outline_commas)


def _extend_runs(runs: list[tuple[int, int]], start: int, end: int) -> None:
    if runs and runs[-1][1] == start:
        runs[-1] = (runs[-1][0], end)
    else:
        runs.append((start, end))
