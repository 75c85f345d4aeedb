"""TGI's response shapes: GenerateResponse, StreamResponse and the generation-error object. TGI's
routes render them, and so do LMI's formatters in `tgi_compat` mode; both import them from here.
Built from `shapes` (tokens, details, text), like LMI's own bodies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmi_serve.dialects.common.shapes import (
    Events, RenderContext, _details, _event_token, _failure, _finish, _generated, _is_failure, _text, _top_tokens,
)

TGI_ERROR_PREFIX = "Request failed during generation: "


def tgi_error_body(message: str | None) -> dict:
    """TGI's object for a request that failed during generation (a response body or a last frame)."""
    return {"error": TGI_ERROR_PREFIX + (message or "unknown error"), "error_type": "generation"}


def tgi_response(ctx: RenderContext, events: Events, others: Sequence[Events] = ()) -> dict:
    """One TGI GenerateResponse (`details` only when asked), or TGI's generation-error object."""
    failed = next((f for f in (_failure(s) for s in (events, *others)) if f is not None), None)
    if failed is not None:
        return tgi_error_body(failed.error)
    body: dict[str, Any] = {"generated_text": _text(ctx, events, full=True)}
    if ctx.details or ctx.decoder_input_details:
        body["details"] = _details(ctx, events, others)
    return body


def tgi_stream_frame(ctx: RenderContext, events: Events) -> dict:
    """A TGI StreamResponse; `index` counts frames from 1."""
    last = events[-1]
    if _is_failure(last):
        return tgi_error_body(last.error)
    frame: dict[str, Any] = {"index": len(events), "token": _event_token(ctx, last)}
    if ctx.top_n_tokens > 0:
        frame["top_tokens"] = _top_tokens(ctx, last)
    done = last.finish_reason is not None
    frame["generated_text"] = _text(ctx, events, full=True) if done else None
    frame["details"] = {"finish_reason": _finish(ctx, events), "generated_tokens": len(_generated(events)),
                        "seed": ctx.seed, "input_length": ctx.prompt_tokens_count} if done else None
    return frame
