"""Helpers shared by the built-in handlers (usable from a user's model.py too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lmi_serve.handler_api import Input, Output

T = TypeVar("T")


def read_payload(item: Input) -> Any:
    """The request body: a text/plain body is the prompt itself, anything else must be JSON."""
    content_type = (item.get_property("Content-Type") or "").lower()
    return item.get_as_string() if content_type.startswith("text/plain") else item.get_as_json()


def parse_batch(inputs: Input, parse: Callable[[Input], T]) -> tuple[Output, dict[int, T]]:
    """Parse every member of a (possibly batched) Input on its own.

    A member whose parse raises ValueError/KeyError gets its own 424 in the returned Output, so
    one bad request never fails the others of its dynamic batch. Returns the Output to fill and
    the parsed members by batch index (empty when nothing is left to run).
    """
    output = Output()
    parsed: dict[int, T] = {}
    for index, item in enumerate(inputs.get_batches()):
        try:
            parsed[index] = parse(item)
        except (ValueError, KeyError) as exc:
            if not inputs.is_batch():
                return output.error(str(exc)), {}
            output.add({"code": 424, "message": "invoke handler failure", "error": str(exc)}, batch_index=index)
            output.add_property(f"batch_{index}.code", "424")
            output.add_property(f"batch_{index}.message", "invoke handler failure")
    return output, parsed
