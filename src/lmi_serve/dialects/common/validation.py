"""pydantic's validation errors as the field problems every dialect words its own way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError


@dataclass(frozen=True)
class FieldProblem:
    loc: tuple[str | int, ...]  # where in the validated object, outermost first
    message: str  # our own validators' text as written; pydantic's own message otherwise
    input: Any  # the value that was refused

    @property
    def field(self) -> str:
        """The top-level field at fault ("" for the object itself)."""
        return str(self.loc[0]) if self.loc else ""

    def where(self, prefix: str = "") -> str:
        """The dotted path, e.g. `parameters.top_k`."""
        return ".".join(str(p) for p in (prefix, *self.loc) if p != "")


def field_problems(error: ValidationError) -> list[FieldProblem]:
    """Every problem in `error`, in pydantic's order. Our validators raise ValueError, whose text
    is shown without pydantic's "Value error, " prefix."""
    return [FieldProblem(tuple(item["loc"]),
                         str(item["ctx"]["error"]) if item["type"] == "value_error" else item["msg"],
                         item.get("input"))
            for item in error.errors()]
