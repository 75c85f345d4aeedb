"""The body limit (option.max_request_bytes) for bodies of unknown length: chunked uploads.

A body that declares its length is refused (413) by Werkzeug before it is read. A chunked body has
no length: Werkzeug reads it through a stream capped at the limit, but that stream stops at the
limit without looking further, so a body one byte or one gigabyte over arrives truncated to the
limit, and the route answers "not valid JSON" (or worse, parses a prefix). `ServingRequest` reads
such a body with room for one byte more, and refuses it (RequestEntityTooLarge: 413 in the route's
dialect) as soon as that byte comes: nothing over the limit is buffered.
"""

from __future__ import annotations

from flask import Request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.utils import cached_property
from werkzeug.wsgi import LimitedStream


class StrictLimit(LimitedStream):
    """A stream of at most `limit` bytes that raises RequestEntityTooLarge when there are more."""

    def __init__(self, stream, limit: int):
        super().__init__(stream, limit + 1, is_max=True)
        self.max_bytes = limit

    def readinto(self, b) -> int | None:  # type: ignore[override]
        size = super().readinto(b)
        if self._pos > self.max_bytes:
            raise RequestEntityTooLarge()
        return size


class ServingRequest(Request):
    """Flask's request, with StrictLimit on a body without Content-Length (the server terminates
    the stream: gunicorn sets wsgi.input_terminated for a chunked body)."""

    @cached_property
    def stream(self):
        limit = self.max_content_length
        if limit is None or self.content_length is not None or "wsgi.input_terminated" not in self.environ:
            return super().stream
        return StrictLimit(self.environ["wsgi.input"], limit)
