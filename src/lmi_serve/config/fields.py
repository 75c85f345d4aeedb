"""What the per-concern option modules share: the base their fields are declared on, the errors a bad
value raises, the parsing of flags and choices, and where the figures their descriptions link to live.

config/models.py assembles the concerns (model_options, engine_options, kernel_options,
adapter_options, request_options, server_options) into the one validated `ModelConfig`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The descriptions are rendered into docs/configuration.md (config/doc.py), so their links are relative to
# docs/; the site's strict build (tests/unit/repo/test_docs.py) fails on a missing page or anchor.
RESULTS = "../benchmarks/RESULTS.md"
JOURNAL = "../benchmarks/journal/2026-11.md"
FAST_CPU = "models.md#faster-on-a-cpu-bf16-and-lighter-weights"

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class ConfigError(ValueError):
    """Invalid or missing configuration; the message starts with the offending key."""


class FieldError(ValueError):
    """A cross-field failure that remembers which field to blame, so its source key can be named."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Options(BaseModel):
    """The base of each concern's options: immutable, unknown keys refused, `model_*` names allowed."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


def parse_bool(value: Any, *, also_true: tuple[str, ...] = ()) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in also_true:
        return True
    if text in _FALSE:
        return False
    extra = "".join(f", {t}" for t in also_true)
    raise ValueError(f"is not a boolean (use true/false, 1/0, yes/no{extra})")


def text(value: Any) -> str:
    """Render a resolved value the way a properties file would spell it."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def choice(value: Any, choices: tuple[str, ...]) -> Any:
    """`value` as one of `choices`, case and surrounding blanks ignored; None stays None."""
    if value is None:
        return None
    spelled = str(value).strip().lower()
    if spelled not in choices:
        raise ValueError(f"is not one of {', '.join(choices)}")
    return spelled
