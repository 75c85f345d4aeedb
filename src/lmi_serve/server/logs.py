"""Log lines: `text` (the default) or `json` (one JSON object per line), for every logger.

`configure` sets the launcher's root handler; `gunicorn_logconfig` gives gunicorn the same
handler and format (its `logconfig_dict`), so the arbiter's lines, the workers' app logs and the
access log (access_log.py) all come out in one format on stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
# JSON keys: time, level, process, logger, message, then a record's extra fields (an access line's).
_JSON_FIELDS = "%(asctime)s %(levelname)s %(process)d %(name)s %(message)s"
_JSON_RENAMES = {"asctime": "time", "levelname": "level", "name": "logger"}


def formatter(log_format: str = "text") -> logging.Formatter:
    """The formatter of `log_format` ("text" or "json")."""
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        # exc_info becomes a field holding the traceback: still one line per record
        return JsonFormatter(_JSON_FIELDS, rename_fields=_JSON_RENAMES, json_ensure_ascii=False)
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")


def configure(level: str, log_format: str) -> None:
    """One stderr handler on the root logger, in `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(log_format == "json")  # warnings.warn lines in the same format


def route_library_logs() -> None:
    """transformers logs through a handler of its own (its `[transformers]` lines, not propagated): send
    its records to the root handler instead, so they come out in the server's format (one JSON object
    per line under `json`). Called in the worker, where transformers is imported anyway."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()


def gunicorn_logconfig(level: str, log_format: str) -> dict[str, Any]:
    """gunicorn's `logconfig_dict`: its error log goes to the root handler, in `log_format`
    (gunicorn's own access log stays off: access_log.py writes one line per request)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"lmi": {"()": "lmi_serve.server.logs.formatter", "log_format": log_format}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "lmi", "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {"gunicorn.error": {"level": level.upper(), "handlers": [], "propagate": True},
                    "gunicorn.access": {"handlers": [], "propagate": False}},
    }
