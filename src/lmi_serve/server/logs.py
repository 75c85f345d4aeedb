"""Log lines: `text` (the default) or `json` (one JSON object per line), for every logger.

`configure` sets the launcher's root handler; `gunicorn_logconfig` gives gunicorn the same
handler and format (its `logconfig_dict`), so the arbiter's lines, the workers' app logs and the
access log (access_log.py) all come out in one format on stderr.

No line is longer than LINE_CHARS characters, whatever a record holds (a message quoting what a
client sent, a traceback of a long value): the formatter cuts it (`BoundedFormatter`), in one
place rather than at every call site, so a client cannot make the log cost what its body did.
The access log's lines are far shorter and come out unchanged.
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
LINE_CHARS = 4096  # the longest line a record may write (a few KiB: room for any message we word)


def formatter(log_format: str = "text") -> logging.Formatter:
    """The formatter of `log_format` ("text" or "json"), its lines cut to LINE_CHARS."""
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        # exc_info becomes a field holding the traceback: still one line per record
        return BoundedFormatter(JsonFormatter(_JSON_FIELDS, rename_fields=_JSON_RENAMES, json_ensure_ascii=False))
    if log_format == "text":
        return BoundedFormatter(logging.Formatter(TEXT_FORMAT))
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")


def cut(text: str, keep: int, *, tail: int = 0) -> str:
    """`text` with all but its first `keep` (and last `tail`) characters replaced by a count."""
    if len(text) <= keep + tail:
        return text
    end = text[len(text) - tail:] if tail else ""
    return f"{text[:keep]}… [{len(text) - keep - tail:,} more characters]{' … ' if tail else ''}{end}"


class BoundedFormatter(logging.Formatter):
    """`inner`'s lines, none over LINE_CHARS. A text record's long physical lines are each cut; a JSON
    record (one line) is formatted again from a copy with its message and traceback shortened, halving
    their share until the line fits (escaping can make the line longer than the text it holds)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        if len(line) <= LINE_CHARS:
            return line
        if "\n" in line:  # text: a traceback or a message of several lines
            return "\n".join(cut(part, LINE_CHARS - 40) for part in line.split("\n"))
        return self._shortened(record, line)

    def _shortened(self, record: logging.LogRecord, line: str) -> str:
        message, trace = record.getMessage(), record.exc_text or (
            self.inner.formatException(record.exc_info) if record.exc_info else None)
        share = LINE_CHARS // 2
        while len(line) > LINE_CHARS and share >= 16:
            copy = logging.makeLogRecord(record.__dict__)
            copy.msg, copy.args, copy.exc_info, copy.stack_info = cut(message, share), None, None, None
            copy.exc_text = cut(trace, share // 2, tail=share // 2) if trace else None
            line, share = self.inner.format(copy), share // 2
        return line if len(line) <= LINE_CHARS else cut(line, LINE_CHARS - 40)


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
