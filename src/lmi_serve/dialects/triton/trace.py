"""The trace extension's settings: GET/POST /v2[/models/<model>]/trace/setting.

Settings are validated and stored, globally and per model, in Triton's shape (every value a
string, `trace_level` an array of strings). A model's setting falls back to the global one until
the model sets its own; an update with `null` clears that override (on the global settings: back to
the server default). No trace is collected or written, so the server metadata does not list the
`trace` extension (docs/triton.md).

Deviations from Triton, each refusing what Triton would silently ignore or misread: an unknown
setting, an unknown trace level or an empty `trace_level` is a 400, and numbers must be whole
decimal integers (Triton's `stoi` reads "12abc" as 12 and "-5" as a huge rate).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from lmi_serve import echo
from lmi_serve.dialects.triton.protocol import BadRequest

LEVELS = ("TIMESTAMPS", "TENSORS")  # in the order Triton lists them; "OFF" stands alone
# Triton's defaults when started without --trace-config options.
DEFAULTS: dict[str, Any] = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                            "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
_UINT32 = (0, 2**32 - 1)
_INT32_MAX = 2**31 - 1
_MIN_TRACE_COUNT = -1  # -1: no limit
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"Unable to parse '{name}': attempt to access JSON non-string as string")
    return value


def _integer(name: str, value: Any) -> int:
    text = _string(name, value)
    if not _INTEGER.fullmatch(text):
        raise BadRequest(f"Unable to parse '{name}', got: {text}")
    return int(text)


def _unsigned(name: str, value: Any) -> str:
    number = _integer(name, value)
    low, high = _UINT32
    if not low <= number <= high:
        raise BadRequest(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {value}")
    return str(number)


def _trace_count(value: Any) -> str:
    count = _integer("trace_count", value)
    if not -2**31 <= count <= _INT32_MAX:
        raise BadRequest(f"Unable to parse 'trace_count', value is out of range [ {_MIN_TRACE_COUNT}, "
                         f"{_INT32_MAX} ], got: {value}")
    if count < _MIN_TRACE_COUNT:
        raise BadRequest(f"Unable to parse 'trace_count'. Expecting value >= {_MIN_TRACE_COUNT}, got:{value}")
    return str(count)


def _trace_level(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest("Unable to parse 'trace_level': attempt to access JSON non-array as array")
    levels = [_string("trace_level", level) for level in value]
    if levels == ["OFF"]:
        return levels
    if "OFF" in levels:
        raise BadRequest("Expect only one trace level 'OFF' is specified")
    unknown = [level for level in levels if level not in LEVELS]
    if unknown or not levels:
        raise BadRequest(f"Unable to parse 'trace_level': expected ['OFF'] or one or more of "
                         f"{list(LEVELS)}, got {echo.names(levels)}")
    return [level for level in LEVELS if level in levels]


def _trace_mode(value: Any) -> str:
    if _string("trace_mode", value) != DEFAULTS["trace_mode"]:
        raise BadRequest(f"Unable to set 'trace_mode' to '{value}': only 'triton' is supported")
    return value


_PARSERS = {"trace_level": _trace_level, "trace_rate": lambda v: _unsigned("trace_rate", v),
            "trace_count": _trace_count, "log_frequency": lambda v: _unsigned("log_frequency", v),
            "trace_file": lambda v: _string("trace_file", v), "trace_mode": _trace_mode}


def parse_update(body: Any) -> dict[str, Any]:
    """A POST body as {setting: new value, or None to clear it}; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("Unable to parse the trace setting request: expected a JSON object")
    unknown = echo.unknown(body, _PARSERS)
    if unknown:
        raise BadRequest(f"Unknown trace setting(s) {echo.names(unknown)}; the settings are {sorted(_PARSERS)}")
    return {name: None if value is None else _PARSERS[name](value) for name, value in body.items()}


class TraceSettings:
    """Global and per-model overrides of DEFAULTS, for this worker process (like the statistics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._global: dict[str, Any] = {}
        self._models: dict[str, dict[str, Any]] = {}

    def get(self, model: str | None = None) -> dict[str, Any]:
        with self._lock:
            effective = {**DEFAULTS, **self._global, **(self._models.get(model, {}) if model else {})}
        return {name: list(value) if isinstance(value, list) else value for name, value in effective.items()}

    def update(self, changes: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """Apply parsed changes (None clears an override) and answer the settings now in force."""
        with self._lock:
            overrides = self._models.setdefault(model, {}) if model else self._global
            for name, value in changes.items():
                if value is None:
                    overrides.pop(name, None)
                else:
                    overrides[name] = value
        return self.get(model)
