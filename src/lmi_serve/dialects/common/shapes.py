"""The pieces every LMI and TGI generation body is built from: the request's RenderContext and
the token, details, text and finish-reason shapes of a sequence's events.

Pure functions of (RenderContext, events). `lmi.formatters` assembles LMI's bodies and lines from
them and `tgi_shapes` TGI's, so LMI and TGI never import each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmi_serve.dialects.common.schema import RollingRequest
from lmi_serve.engine.types import FinishReason, TokenEvent, TopToken

Events = Sequence[TokenEvent]
FinalRenderer = Callable[["RenderContext", Events, Sequence[Events]], str]
ChunkRenderer = Callable[["RenderContext", Events], str]

_LMI_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "eos_token",
               FinishReason.STOP_SEQUENCE: "stop_sequence", FinishReason.ERROR: "error",
               FinishReason.CANCELLED: "abort"}
_TGI_FINISH = {**_LMI_FINISH, FinishReason.CANCELLED: "length"}


@dataclass(frozen=True)
class RenderContext:
    """What a renderer needs to know about the request besides its events."""

    inputs: str
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    return_full_text: bool = False
    tgi_compat: bool = False
    seed: int | None = None  # the best sequence's sampling seed; None when greedy
    prompt_tokens_count: int = 0
    other_seeds: tuple[int | None, ...] = ()  # the seeds of `others` (best_of_sequences), in order

    @classmethod
    def for_request(cls, request: RollingRequest, *, tgi_compat: bool, seed: int | None,
                    prompt_tokens_count: int) -> "RenderContext":
        p = request.parameters
        return cls(request.inputs, p.details, p.decoder_input_details, p.top_n_tokens, p.return_full_text,
                   tgi_compat, seed, prompt_tokens_count)


# --- pieces ---------------------------------------------------------------------------------

def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _token(ctx: RenderContext, token_id: int, text: str, logprob: float | None, special: bool) -> dict:
    if ctx.tgi_compat:
        return {"id": token_id, "text": text, "logprob": _finite(logprob), "special": bool(special)}
    token = {"id": token_id, "text": text, "log_prob": _finite(logprob)}
    if special:
        token["special_token"] = True
    return token


def _event_token(ctx: RenderContext, event: TokenEvent) -> dict:
    return _token(ctx, event.token_id, event.text, event.logprob, event.special)


def _top_tokens(ctx: RenderContext, event: TokenEvent) -> list[dict]:
    return [_token(ctx, t.token_id, t.text, t.logprob, t.special) for t in event.top_tokens]


def _prefill(ctx: RenderContext, events: Events) -> list[dict]:
    prompt: Sequence[TopToken] = (events[0].prompt_tokens or ()) if events else ()
    out = []
    for i, t in enumerate(prompt):
        logprob = None if i == 0 else _finite(t.logprob)
        out.append({"id": t.token_id, "text": t.text, "logprob": logprob} if ctx.tgi_compat
                   else {"id": t.token_id, "text": t.text, "log_prob": logprob})
    return out


def _is_failure(event: TokenEvent) -> bool:
    return event.finish_reason is FinishReason.ERROR


def _generated(events: Events) -> list[TokenEvent]:
    """Real generated tokens: no failure or other id-less marker events."""
    return [e for e in events if e.token_id >= 0 and not _is_failure(e)]


def _finish(ctx: RenderContext, events: Events) -> str | None:
    reason = events[-1].finish_reason if events else None
    if reason is None:
        return None
    return (_TGI_FINISH if ctx.tgi_compat else _LMI_FINISH)[reason]


def _text(ctx: RenderContext, events: Events, *, full: bool) -> str:
    text = "".join(e.text for e in events)
    return ctx.inputs + text if full and ctx.return_full_text else text


def _failure(events: Events) -> TokenEvent | None:
    return events[-1] if events and _is_failure(events[-1]) else None


# --- final body (json) ----------------------------------------------------------------------

def _sequence(ctx: RenderContext, events: Events, prefill: list[dict], seed: int | None) -> dict:
    """A best_of_sequences entry (`prefill`: the prompt's, shared by all sequences)."""
    tokens = _generated(events)
    seq = {"generated_text": _text(ctx, events, full=True), "finish_reason": _finish(ctx, events),
           "generated_tokens": len(tokens), "tokens": [_event_token(ctx, e) for e in tokens]}
    if ctx.tgi_compat:
        seq["seed"] = seed
        seq["prefill"] = prefill
    if ctx.top_n_tokens > 0:
        seq["top_tokens"] = [_top_tokens(ctx, e) for e in tokens]
    return seq


def _details(ctx: RenderContext, events: Events, others: Sequence[Events]) -> dict:
    tokens = _generated(events)
    prefill = _prefill(ctx, events) if ctx.decoder_input_details else []
    details: dict[str, Any] = {"finish_reason": _finish(ctx, events), "generated_tokens": len(tokens),
                               "inputs": ctx.inputs, "tokens": [_event_token(ctx, e) for e in tokens]}
    if ctx.tgi_compat:
        details["seed"] = ctx.seed
    if ctx.tgi_compat or ctx.decoder_input_details:
        details["prefill"] = prefill
    if ctx.top_n_tokens > 0:
        details["top_tokens"] = [_top_tokens(ctx, e) for e in tokens]
    if others:
        seeds = ctx.other_seeds or (None,) * len(others)
        details["best_of_sequences"] = [_sequence(ctx, seq, prefill, seed)
                                        for seq, seed in zip(others, seeds, strict=True)]
    return details
