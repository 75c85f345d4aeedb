"""Which tokens each row may choose next: one [rows, vocab] bool mask for the sampler.

Two kinds of limits, combined per row at every step:
1. hard: the row's grammar (`grammar.allowed_tokens`) and its `allowed_token_ids`. The sampler can
   only choose a token both allow.
2. soft: tokens banned for now: EOS and `stop_token_ids` while fewer than `min_new_tokens` are
   generated, and the last token of a `banned_sequences` entry whose other tokens were just
   generated. A soft ban never empties a row: where it would leave nothing the hard limits allow
   (e.g. a grammar that accepts only EOS), that row keeps the hard mask alone.
A row with no limit is all True, and no mask exists (None) when no row has one, so an unlimited
batch pays nothing. Each row's mask depends only on that row's request and history.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmi_serve.engine.sampling.grammar import allowed_tokens


def banned_now(request, generated: Sequence[int]) -> set[int]:
    """Tokens `request` may not choose after generating `generated` (its soft bans)."""
    stop, banned = request.stop, set()
    if len(generated) < stop.min_new_tokens:
        banned |= stop.stop_token_ids | (frozenset() if stop.ignore_eos else stop.eos_token_ids)
    for sequence in request.sampling.banned_sequences:
        prefix = sequence[:-1]
        if not prefix or tuple(generated[len(generated) - len(prefix):]) == prefix:
            banned.add(sequence[-1])
    return banned


def _limited(request) -> bool:
    return (request.sampling.allowed_token_ids is not None or bool(request.sampling.banned_sequences)
            or request.stop.min_new_tokens > 0)


def _hard_mask(rows, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    allowed = allowed_tokens([row.constraint for row in rows], vocab_size, device)
    for i, row in enumerate(rows):
        ids = row.request.sampling.allowed_token_ids
        if ids is None:
            continue
        if allowed is None:
            allowed = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
        only = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        only[[t for t in ids if 0 <= t < vocab_size]] = True
        allowed[i] &= only
    return allowed


def token_mask(rows, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The [rows, vocab] mask of tokens each row may choose now, or None when every token is.
    `rows` are the batch's `Row`s (request, constraint, generated token ids)."""
    allowed = _hard_mask(rows, vocab_size, device)
    if not any(_limited(row.request) for row in rows):
        return allowed
    for i, row in enumerate(rows):
        banned = [t for t in banned_now(row.request, row.token_ids) if 0 <= t < vocab_size]
        if not banned:
            continue
        if allowed is None:
            allowed = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
        softened = allowed[i].clone()
        softened[banned] = False
        # Where the bans would leave nothing, keep the hard mask: chosen on the device, not read back
        # (`if softened.any()` would be a host sync per row on a GPU).
        allowed[i] = torch.where(softened.any(), softened, allowed[i])
    return allowed
