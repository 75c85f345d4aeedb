"""SageMaker Batch Transform's MultiRecord mini-batches on /invocations (and /predictions/<m>).

With SplitType=Line and BatchStrategy=MultiRecord, SageMaker packs several JSON Lines records into
one request body. The rule that tells such a body from a single record (`split_records`):
- a `text/*` body is never split: a text/plain body is the prompt itself, newlines included;
- fewer than two non-blank lines: one record, served exactly as before;
- Content-Type application/jsonlines (or x-jsonlines, jsonl, ndjson): every non-blank line is a record;
- any other type (application/json, none): several records only if the first non-blank line is a
  whole JSON value by itself. A JSON text is exactly one value, so a body whose first line is a
  complete value followed by more is never one document; a pretty-printed document starts with a
  line like `{` that decodes to nothing, and stays single. (So with application/json a broken first
  line makes the whole body one broken record: the LMI error for invalid JSON, as before.)
  A handler with its own @input_formatter only gets bodies split when they say jsonlines.
Blank lines (and a final newline) are no records; `\\r\\n` endings are accepted.

Each record is answered by the same code as the record sent alone (`answer`), all of them at once
on a small pool of threads, so they are in the engine together and share its steps. The answer is
JSON Lines in input order, one line per record, status 200: a bad record is answered in its place
by the error object LMI uses for it (the handler's `{"error", "code"}`, or the route's error body
for a kind the route renders), and the others still succeed. A record asking to stream is refused:
a mini-batch answer is one whole body.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lmi_serve import json_body
from lmi_serve.errors import ClientGone, InvalidRequest, ServingError, lookup
from lmi_serve.handler_api import Input, Output

log = logging.getLogger(__name__)

JSONLINES_TYPES = frozenset({"application/jsonlines", "application/x-jsonlines", "application/jsonl",
                             "application/x-ndjson", "application/ndjson"})
JSONLINES = "application/jsonlines"
STREAM_REFUSED = ("Streaming is not available for a record of a multi-record (JSON Lines) body: each record "
                  "is answered by one line of a whole response. Send it alone to stream it.")


def split_records(body: bytes, content_type: str | None, *, sniff: bool = True) -> list[bytes] | None:
    """The records of a multi-record body, or None when it is one record (see the module docstring).
    `sniff`: whether a body that does not say jsonlines may still be split."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media.startswith("text/") or b"\n" not in body:
        return None
    lines = [line for line in body.split(b"\n") if line.strip()]
    if len(lines) < 2:
        return None
    if media in JSONLINES_TYPES:
        return lines
    if not sniff:
        return None
    try:
        json_body.loads(lines[0])
    except json_body.InvalidJson:
        return None
    return lines


def record_input(item: Input, record: bytes) -> Input:
    """An Input for one record: the request's headers (adapter, Accept...) and query parameters
    (DJL's content entries), with the line as the JSON body."""
    properties = {k: v for k, v in item.properties.items() if k.lower() not in ("content-type", "content-length")}
    properties["Content-Type"] = "application/json"
    single = Input(properties)
    single.content.add("data", record.strip())
    for key, value in item.content:
        if key != "data":
            single.content.add(key, value)
    single.function_name = item.function_name
    return single


def _asks_to_stream(record: bytes) -> bool:
    try:
        payload = json_body.loads(record)
    except json_body.InvalidJson:
        return False  # the record's own answer says what is wrong with it
    return isinstance(payload, dict) and bool(payload.get("stream"))


def _one_line(body: bytes) -> bytes:
    """`body` as one JSON line: verbatim when it has no newline, else re-encoded compactly (a JSON
    body), or as a JSON string (any other text)."""
    if b"\n" not in body and b"\r" not in body:
        return body
    try:
        value = json.loads(body)
    except ValueError:
        value = body.decode("utf-8", "replace")
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


class RecordAnswerer:
    """Answers the records of one body with `answer` (the single-record path, which turns the errors
    it owns into its Output); `refusal(error)` is the handler's Output for a refused record, and
    `route_error(error)` the body (status, dict) the route would render for a kind it propagates."""

    def __init__(self, answer: Callable[[Input], Output], refusal: Callable[[ServingError], Output | None],
                 route_error: Callable[[ServingError], dict], workers: int):
        self.answer = answer
        self.refusal = refusal
        self.route_error = route_error
        self.workers = max(1, workers)

    def answer_all(self, item: Input, records: list[bytes]) -> Output:
        workers = min(self.workers, len(records))
        with ThreadPoolExecutor(workers, thread_name_prefix="multi-record") as pool:
            # each thread runs in a copy of this request's context: the client-gone watch reads it
            futures = [pool.submit(contextvars.copy_context().run, self._line, item, record) for record in records]
            lines = [future.result() for future in futures]  # in input order; ClientGone ends the body
        body = b"\n".join(lines) + b"\n"
        return Output().add(body).add_property("Content-Type", JSONLINES)

    def _line(self, item: Input, record: bytes) -> bytes:
        if _asks_to_stream(record):
            return self._refused(InvalidRequest(STREAM_REFUSED, param="stream"))
        try:
            output = self.answer(record_input(item, record))
        except ClientGone:
            raise
        except ServingError as exc:  # a kind the route renders (Overloaded, Timeout...): its body, in place
            return json.dumps(self.route_error(exc), ensure_ascii=False).encode("utf-8")
        except Exception:  # a bug answering one record fails that record only
            log.exception("Answering one record of a multi-record body failed")
            return json.dumps({"code": 500, "type": "InternalServerException",
                               "message": "Internal error answering this record",
                               "error": "Internal error answering this record"}).encode("utf-8")
        if output.is_stream():  # a server option that streams by default: refused after all
            close = getattr(output.stream_content, "close", None)
            if close is not None:
                close()  # cancels its generation
            return self._refused(InvalidRequest(STREAM_REFUSED, param="stream"))
        return _one_line(output.body())

    def _refused(self, error: ServingError) -> bytes:
        output = self.refusal(error)
        if output is None:
            return json.dumps(self.route_error(error), ensure_ascii=False).encode("utf-8")
        return _one_line(output.body())


def route_error_body(table: dict, error: ServingError) -> dict:
    """The route's error body for `error` from an error table of (status, type) rows (LMI's)."""
    status, error_type = lookup(table, error)
    return {"code": status, "type": error_type, "message": error.message, "error": error.message}
