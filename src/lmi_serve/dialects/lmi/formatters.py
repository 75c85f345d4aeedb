"""LMI output formatters: pure functions from (RenderContext, events so far) to text.

A formatter never touches Flask, the engine or status codes. `events` is everything generated so
far for the best sequence; its last event carries `finish_reason` when the sequence is done, and a
failure ends it with `TokenEvent.failure(msg)` (finish_reason ERROR).

Registry (`FORMATTERS`, name -> OutputFormatter): `json` renders one final body, `jsonlines` and
`sse` render one chunk per event. `choose_formatter` picks: per-request `parameters.output_formatter`,
then a model.py `@output_formatter` (wrapped by `hooks.custom_formatter`), then
`option.output_formatter`, then the default (`json`, or `jsonlines` when streaming, or `sse` when
streaming with tgi_compat). The framing of a chunk (an SSE event, a JSON line) is `streaming`'s.

Decisions:
- The formatter decides the framing (`OutputFormatter.streams`): a chunk-only formatter streams even
  for `stream=false` (LMI: "stream=true, or option.output_formatter=jsonlines"); a final-only one
  (`json`) answers a `stream=true` request with one body once generation ends; one with both (a
  custom formatter) follows the request's flag.
- Every generated token gets a stream line, also while its text is held back (text ""), so the
  concatenated `token.text` of all lines equals the final `generated_text` without the prompt.
- tgi_compat changes the shapes, not the framing: TGI tokens (`special` always present), a one-element
  JSON array for the final body with `details` always (`prefill` always a list, `seed`), TGI
  StreamResponse objects as chunks (as SSE frames or, if jsonlines is chosen, as lines), and TGI error
  objects. `finish_reason` there is only length | eos_token | stop_sequence: CANCELLED shows as `length`
  (nobody reads a cancelled response), LMI shows it as `abort`.
- Streams (LMI shapes) add `top_tokens` to each line when top_n_tokens > 0 and `prefill` to the final
  `details` when decoder_input_details. TGI stream details have no place for prefill.
- A failure in any sequence (best or `others`) renders the error shape for the whole response.
- Non-finite logprobs render as null; the first prefill token's logprob is always null.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmi_serve.dialects.common.schema import LmiRequestError
from lmi_serve.dialects.common.shapes import (
    ChunkRenderer, Events, FinalRenderer, RenderContext, _details, _event_token, _failure, _finish, _generated,
    _is_failure, _prefill, _text, _top_tokens,
)
from lmi_serve.dialects.common.streaming import JSONLINES_MIMETYPE, SSE_MIMETYPE, json_line, sse_event
from lmi_serve.dialects.common.streaming import dumps as _dumps  # the one JSON writer, under the name the renderers use
from lmi_serve.dialects.common.tgi_shapes import tgi_error_body as _tgi_error
from lmi_serve.dialects.common.tgi_shapes import tgi_stream_frame


def render_json(ctx: RenderContext, events: Events, others: Sequence[Events] = ()) -> str:
    """Non-streaming body: `{"generated_text", "details"?}`; tgi_compat: `[{...}]` with details."""
    failed = next((f for f in (_failure(s) for s in (events, *others)) if f is not None), None)
    if failed is not None:
        if ctx.tgi_compat:
            return _dumps(_tgi_error(failed.error))
        return _dumps({"generated_text": "", "details": {"finish_reason": "error", "generated_tokens": None,
                                                         "inputs": None, "tokens": None},
                       "error": failed.error})
    body: dict[str, Any] = {"generated_text": _text(ctx, events, full=True)}
    if ctx.details or ctx.tgi_compat:
        body["details"] = _details(ctx, events, others)
    return _dumps([body] if ctx.tgi_compat else body)


# --- chunks (jsonlines, sse) ----------------------------------------------------------------

def _lmi_line(ctx: RenderContext, events: Events) -> dict:
    last = events[-1]
    if _is_failure(last):
        return {"token": {"id": -1, "text": "", "log_prob": -1, "special_token": True}, "generated_text": "",
                "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
                "error": last.error}
    line: dict[str, Any] = {"token": _event_token(ctx, last)}
    if ctx.top_n_tokens > 0:
        line["top_tokens"] = _top_tokens(ctx, last)
    if last.finish_reason is not None:
        line["generated_text"] = _text(ctx, events, full=True)
        if ctx.details:
            details = {"finish_reason": _finish(ctx, events), "generated_tokens": len(_generated(events)),
                       "inputs": ctx.inputs}
            if ctx.decoder_input_details:
                details["prefill"] = _prefill(ctx, events)
            line["details"] = details
    return line


def _chunk_object(ctx: RenderContext, events: Events) -> dict:
    if not events:
        raise ValueError("a chunk is rendered for the last of at least one event")
    return tgi_stream_frame(ctx, events) if ctx.tgi_compat else _lmi_line(ctx, events)


def render_jsonlines_chunk(ctx: RenderContext, events: Events) -> str:
    """The jsonlines line for the last event (see the module docstring)."""
    return json_line(_chunk_object(ctx, events))


def render_sse_chunk(ctx: RenderContext, events: Events) -> str:
    """One server-sent event for the last event; never a `[DONE]` sentinel."""
    return sse_event(_chunk_object(ctx, events))


# --- registry -------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutputFormatter:
    name: str
    mimetype: str
    render_final: FinalRenderer | None = None
    render_chunk: ChunkRenderer | None = None

    def streams(self, stream: bool) -> bool:
        """Chunks or one body? Chunk-only formatters always stream; final-only never; both: `stream`."""
        if self.render_chunk is None:
            return False
        return stream or self.render_final is None

    def render_body(self, ctx: RenderContext, events: Events, others: Sequence[Events] = ()) -> str:
        """The whole response at once: the final render, or every chunk joined."""
        if self.render_final is not None:
            return self.render_final(ctx, events, others)
        assert self.render_chunk is not None
        return "".join(self.render_chunk(ctx, events[:i]) for i in range(1, len(events) + 1))


FORMATTERS: dict[str, OutputFormatter] = {
    "json": OutputFormatter("json", "application/json", render_final=render_json),
    "jsonlines": OutputFormatter("jsonlines", JSONLINES_MIMETYPE, render_chunk=render_jsonlines_chunk),
    "sse": OutputFormatter("sse", SSE_MIMETYPE, render_chunk=render_sse_chunk),
}


def _lookup(name: str, where: str) -> OutputFormatter:
    try:
        return FORMATTERS[name]
    except KeyError:
        raise LmiRequestError(f"{where}: unknown output formatter {name!r}; choose one of "
                              f"{sorted(FORMATTERS)}") from None


def choose_formatter(requested: str | None, configured: str | None, stream: bool, tgi_compat: bool, *,
                     custom: OutputFormatter | None = None) -> OutputFormatter:
    """Per-request name > model.py `@output_formatter` (`custom`, see `hooks.custom_formatter`) >
    option.output_formatter > default."""
    if requested:
        return _lookup(requested, "parameters.output_formatter")
    if custom is not None:
        return custom
    if configured:
        return _lookup(configured, "option.output_formatter")
    if not stream:
        return FORMATTERS["json"]
    return FORMATTERS["sse" if tgi_compat else "jsonlines"]
