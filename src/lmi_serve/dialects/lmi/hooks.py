"""A model.py's formatter hooks (DJL's `@input_formatter` / `@output_formatter`) on the rolling batch.

- `apply_input_formatter`: the user's function turns the request Input into the rolling-batch
  payload, which the schema then parses like any request's.
- `custom_formatter`: the user's output function as an OutputFormatter, fed a `GenerationOutput`
  (LMI's view of the tokens so far) per event when streaming, once at the end otherwise.

User code runs here only; the formatters and the schema know nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lmi_serve.dialects.common.schema import LmiRequestError, RollingRequest, parse_rolling_request
from lmi_serve.dialects.common.shapes import Events, RenderContext, _details, _text
from lmi_serve.dialects.common.streaming import JSONLINES_MIMETYPE, dumps
from lmi_serve.dialects.lmi.formatters import OutputFormatter
from lmi_serve.handler_api import Input


@dataclass(frozen=True)
class GenerationOutput:
    """What a model.py `@output_formatter` function sees, once per event or once at the end."""

    inputs: str
    generated_text: str  # with the prompt when return_full_text
    tokens: list[dict]  # LMI Token dicts of the tokens so far
    finished: bool
    finish_reason: str | None  # LMI strings: length | eos_token | stop_sequence | error | abort
    details: dict  # LMI details (always filled, whatever `details` says); best_of_sequences at the end
    error: str | None = None


def generation_output(ctx: RenderContext, events: Events, others: Sequence[Events] = ()) -> GenerationOutput:
    lmi = replace(ctx, details=True, tgi_compat=False)
    last = events[-1] if events else None
    details = _details(lmi, events, others)
    return GenerationOutput(
        inputs=ctx.inputs, generated_text=_text(lmi, events, full=True), tokens=details["tokens"],
        finished=last is not None and last.finish_reason is not None, finish_reason=details["finish_reason"],
        details=details, error=last.error if last is not None else None)


def _as_text(value: Any) -> str:
    """A formatter returns a str ("" emits nothing); None is "", other values are sent as JSON."""
    if value is None:
        return ""
    return value if isinstance(value, str) else dumps(value)


def custom_formatter(fn: Callable[[GenerationOutput], Any], *, stream: bool = False) -> OutputFormatter:
    """Wrap a model.py `@output_formatter`: called per event when streaming, once otherwise.

    The MIME type is `fn.content_type` when set, else application/jsonlines for a stream and
    application/json otherwise."""
    mimetype = getattr(fn, "content_type", None) or (JSONLINES_MIMETYPE if stream else "application/json")

    def render_final(ctx: RenderContext, events: Events, others: Sequence[Events] = ()) -> str:
        return _as_text(fn(generation_output(ctx, events, others)))

    def render_chunk(ctx: RenderContext, events: Events) -> str:
        return _as_text(fn(generation_output(ctx, events)))

    return OutputFormatter(getattr(fn, "__name__", "custom"), mimetype, render_final, render_chunk)


def apply_input_formatter(fn: Callable[..., Any], item: Input, **kwargs: Any) -> RollingRequest:
    """Run a model.py `@input_formatter` and parse what it returns with the rolling-batch schema.

    `fn(item, **kwargs)` returns `{"inputs", "parameters"?, "stream"?}` (or a RollingRequest).
    Any exception becomes an LmiRequestError carrying its message."""
    try:
        payload = fn(item, **kwargs)
    except LmiRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code; the message goes back to the client
        raise LmiRequestError(f"Input formatter {getattr(fn, '__name__', 'input_formatter')} failed: "
                              f"{exc}") from exc
    if isinstance(payload, RollingRequest):
        return payload
    return parse_rolling_request(payload)
