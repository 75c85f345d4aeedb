"""Names from a request, as an error body or a log line lists them: a few, then a count of the rest.

A client chooses how many names it sends (3 million unknown fields fit in a 64 MiB body) and how
long each one is; an answer or a log line that echoed them all would cost the server, the log and
the client that much again. So every listing of request names goes through `names`: at most
SHOWN of them, each at most NAME_CHARS long, the smallest in sorted order (the same listing for the
same request, picked in linear time: no sort of millions of names), then "and N more".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

SHOWN = 8  # names listed; the rest are counted
NAME_CHARS = 64  # characters of one name shown; a longer one is cut and marked
TEXT_CHARS = 256  # characters of one listed problem (which may quote a value the client sent)


def short(name: object, limit: int = NAME_CHARS) -> str:
    """`name` as text, cut to `limit` characters (a cut one ends with `…`)."""
    text = str(name)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def names(found: Iterable[object], shown: int = SHOWN) -> str:
    """`['a', 'b']`; over `shown` names, `['a', ..., 'h'] and 99,992 more`. As a Python list
    reads (the form these messages have always had), each name cut by `short`."""
    every = found if isinstance(found, (set, frozenset, dict, list, tuple)) else list(found)
    first = heapq.nsmallest(shown, every, key=str)
    listed = repr([short(name) for name in first])
    rest = len(every) - len(first)
    return f"{listed} and {rest:,} more" if rest else listed


def first(found: Iterable[object]) -> str | None:
    """The name `names` lists first, cut by `short` (an error's `param`); None for none."""
    smallest = heapq.nsmallest(1, found, key=str)
    return short(smallest[0]) if smallest else None


def unknown(given: Iterable[object], known: Iterable[object]) -> list[object]:
    """The names of `given` that are not in `known`, in `given`'s order (no sort: `names` picks)."""
    allowed = set(known)
    return [name for name in given if name not in allowed]


def listing(texts: Sequence[str], sep: str = "; ", shown: int = SHOWN) -> str:
    """The first `shown` of `texts` in their order, each cut to TEXT_CHARS, joined by `sep`; then
    `and N more` (validation problems: pydantic reports one per bad field, a client picks how many)."""
    listed = sep.join(short(text, TEXT_CHARS) for text in texts[:shown])
    rest = len(texts) - shown
    return f"{listed}{sep}and {rest:,} more" if rest > 0 else listed
