"""Decode a request body as JSON, refusing what the rest of the server cannot handle safely.

Every dialect decodes its bodies here, so one rule holds on every route:
- nesting deeper than `MAX_DEPTH` is refused *before* decoding (the decoder and everything that
  walks the result recurse; 1,000 levels raise RecursionError, 5,000 once hung a request), found by
  one linear, bounded-memory pass (`json_scan`) that also hints at surrogate escapes;
- a string holding a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, not valid Unicode) is
  refused, since no tokenizer, encoder or renderer can take it;
- `NaN`, `Infinity` and `-Infinity` (not JSON) are refused;
- a long array of numbers is decoded a piece at a time (json_bulk), letting the worker's other
  threads run between pieces;
- a body with more object keys than the route can use (`max_keys`: MAX_KEYS, or a route's own
  cap) is refused *before* decoding, counted by the same pass: the decoder holds the GIL while it
  builds every entry (3.3 million keys held a worker 13-16 s; orjson and msgspec, measured, hold it
  too, 2-2.5 s), so the other requests of the worker would wait that long;
- so is a body with more values in its arrays and objects than the route can use (`max_values`:
  MAX_VALUES, or a route's own cap), counted by their commas: decoding 33.5 million numbers, even
  a piece at a time (json_bulk), held a stream on the same worker 1.4-3 s, since the stream's
  engine thread needs the GIL between every two torch operations and waits for each piece.
Failures raise `InvalidJson` (a ValueError) with a message for the client; callers let it go, and
each dialect's error table renders it (Triton in its own words).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from lmi_serve import json_bulk
from lmi_serve.json_scan import BodyScan, scan

MAX_DEPTH = 128  # far beyond any real request (JSON Schemas, tool parameters, tensors of rank 8)
# Object keys in one body, all objects together. The largest object a request can use is OpenAI's
# `logit_bias`, one key per token of the vocabulary (256k for the largest served here); a custom
# handler on /invocations gets the same room. Decoding this many takes ~0.3 s.
MAX_KEYS = 262_144
# TGI's and Triton's bodies have fixed schemas (tens of keys, plus a grammar or request parameters).
FIXED_SCHEMA_KEYS = 131_072
# Values in the arrays and objects of one body, all together (counted by their commas, so this many
# plus one is refused). The largest arrays a request can use are token ids: a batch of prompts or
# embedding inputs (32 prompts of 128k tokens), or a custom handler's list on /invocations. Decoding
# this many small numbers holds the GIL ~0.3 s in all (60-100 ns each); a larger tensor goes as
# binary data on Triton's routes, whose JSON tensors have a cap of their own (dialects/triton/infer.py).
MAX_VALUES = 4_194_304
FIXED_SCHEMA_VALUES = 262_144  # TGI's and Triton's other bodies: lists of stop words, a grammar's enums


class InvalidJson(ValueError):
    """The body is not JSON this server accepts. `message` (and `str()`) is a sentence for the
    client; `reason` is the same without "The request body ..." for a dialect that words its own.

    Each dialect's error table has a row for it, as for the core's kinds, whose fields it carries
    (`message`, `param`, `code`). It is no ServingError on purpose: a custom handler whose
    `get_as_json` fails has failed (DJL's 424), while a ServingError would pass through as a kind."""

    param: str | None = None
    code: str | None = None

    def __init__(self, reason: str, lead: str = "The request body is not acceptable JSON"):
        self.message = f"{lead}: {reason}"
        super().__init__(self.message)
        self.reason = reason


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data`, brackets inside strings not counted."""
    return scan(data).depth


def _reject_constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not a valid JSON value", "The request body is not valid JSON")


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) in `value` that is not valid Unicode, iteratively."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH,
          object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
          scanned: BodyScan | None = None, max_keys: int = MAX_KEYS, max_values: int = MAX_VALUES) -> Any:
    """Decode `data` under the rules of the module docstring; raises InvalidJson.
    `object_pairs_hook` builds each object from its (key, value) pairs, as in `json.loads`
    (e.g. to notice a key given twice); the result must still be a dict. `scanned` is
    `json_scan.scan(data)` when the caller has it already (the body is then not scanned again).
    `max_keys`, `max_values`: the route's caps on object keys and on values (module docstring)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not raw or raw.isspace():  # (raw.strip() would copy the body)
        raise InvalidJson("empty body", "The request body is empty; a JSON value is required")
    facts = scanned if scanned is not None else scan(raw, max_keys=max_keys, max_commas=max_values)
    if facts.depth > max_depth:
        raise InvalidJson(f"nested {facts.depth} levels deep; at most {max_depth} levels are allowed")
    if facts.keys > max_keys:
        raise InvalidJson(f"{facts.keys:,} object keys; this route takes at most {max_keys:,}")
    if facts.commas >= max_values:  # commas + 1 values at least
        raise InvalidJson(f"at least {facts.commas + 1:,} values in its arrays and objects; "
                          f"this route takes at most {max_values:,}")
    piecewise = bool(facts.flat_runs) and not isinstance(data, str)  # long arrays of numbers (json_bulk)
    try:
        text = data if isinstance(data, str) or piecewise else raw.decode("utf-8")  # RFC 8259: UTF-8, never sniffed
        if piecewise:
            value = json_bulk.loads(raw, facts.flat_runs, _reject_constant, object_pairs_hook)
        else:
            value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as exc:
        raise InvalidJson(str(exc), "The request body is not valid UTF-8") from None
    except InvalidJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise InvalidJson(str(exc), "The request body is not valid JSON") from None
    if facts.surrogate_escape:  # the scan's hint first: paired surrogates (emoji) decode fine
        bad = _lone_surrogate(value)
        if bad is not None:
            shown = bad.encode("utf-8", "backslashreplace").decode("ascii")[:80]
            raise InvalidJson(f"the string {shown!r} holds a lone UTF-16 surrogate, which is not valid Unicode")
    return value
