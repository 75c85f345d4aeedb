"""The access log: one line per request once its response is over (a stream: when it ends).

Fields: request_id, method, route (the URL rule, e.g. `/v2/models/<model>/infer`, never the query),
model, status, prompt_tokens, generated_tokens, ttft_s, total_s, and `deadline_exceeded` (True) only on
the lines of requests their generation deadline cut (option.generation_deadline). Tokens and the time to
the first token are the engine's (observer.RequestTally: every sequence the request submitted, counted by
their SequenceClocks), never a dialect's rendering; they are null for a request that ran no
sequence of the rolling batch (health, metadata, embeddings, dynamic batching, beam search).
Nothing a client sent is written: no text, no headers, no query; the one exception is SageMaker's own
X-Amzn-SageMaker-Target-Model on a multi-model endpoint's invoke (`target_model`, the model archive
InvokeEndpoint named, which AWS forwards for logging), on those lines only.

The same record (the line's values, the tally, the clock) then goes to `then`, when given: the
request's trace span (server/tracing.py) is made from it, so nothing is counted twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flask import Response, g, request

from lmi_serve.engine.observer import CURRENT_TALLY, RequestTally

log = logging.getLogger("lmi_serve.access")


def request_started() -> None:
    """before_request: the request's clock and tally, current on this thread while the view runs
    (sequences submitted from it count; a stream's later events still reach the same tally)."""
    g.access_started = time.monotonic()
    g.access_tally = RequestTally()
    g.access_token = CURRENT_TALLY.set(g.access_tally)


def request_torn_down() -> None:
    """teardown_request: no later work on this thread counts for this request."""
    token = g.pop("access_token", None)
    if token is not None:
        CURRENT_TALLY.reset(token)


#: After the line is written: (its values, the tally, the request's start, its end), times time.monotonic()
RequestOver = Callable[[dict[str, Any], RequestTally, float, float], None]


def response_ready(response: Response, then: RequestOver | None = None) -> None:
    """after_request: write the line when the response is closed (after its last byte, or when the
    client went away), with what is known now (the request context is gone by then); then call `then`."""
    started = g.get("access_started")
    if started is None:
        return
    fields = {"request_id": g.get("request_id", ""), "method": request.method,
              "route": request.url_rule.rule if request.url_rule is not None else None,
              "model": g.get("model_name") or None, "status": response.status_code}
    if g.get("target_model"):
        fields["target_model"] = g.target_model
    tally = g.access_tally
    response.call_on_close(lambda: over(fields, tally, started, then))


def line_fields(fields: dict[str, Any], tally: RequestTally, started: float, now: float) -> dict[str, Any]:
    """The access line's fields, in their order."""
    counted = tally.sequences > 0
    ttft = tally.ttft_seconds
    line = {**fields,
            "prompt_tokens": tally.prompt_tokens if counted else None,
            "generated_tokens": tally.generated_tokens if counted else None,
            "ttft_s": round(ttft, 6) if ttft is not None else None,
            "total_s": round(now - started, 6)}
    if tally.deadline_cuts:
        line["deadline_exceeded"] = True
    return line


def over(fields: dict[str, Any], tally: RequestTally, started: float, then: RequestOver | None) -> None:
    now = time.monotonic()
    values = line_fields(fields, tally, started, now)
    text = " ".join(f"{key}={'-' if value is None else value}" for key, value in values.items())
    log.info(text, extra=values)
    if then is not None:
        then(values, tally, started, now)
