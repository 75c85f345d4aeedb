"""The full-sort sampler that engine/sampling/sampler.py was before its candidate sets (commit d788aea),
kept as the reference the lean one must equal: it sorts every sampled row's whole vocabulary.
`full_sort_sample` is its `__call__`; the parameter tensors are built here from the params.

One change: typical-p runs only on the rows that ask for it. The old sampler ran it on every sampled
row once one did, and at typical_p=1 the rounding of its cumulative sum dropped tokens of the last
~1e-7 of a row's mass (and changed which of two equal scores its sort put first), so a row's
distribution depended on the other rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmi_serve.engine.types import SamplingParams


def _column(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)[:, None]


def _typical(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.nan_to_num(logp, neginf=0.0)).sum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    order = torch.argsort(distance, dim=-1)
    sorted_p = p.gather(-1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = before >= typical_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def penalised_scores(params: Sequence[SamplingParams], logits: torch.Tensor, seen=None, counts=None,
                     allowed=None) -> torch.Tensor:
    """Penalties, logit biases and the `allowed` mask, as the sampler applies them before choosing."""
    scores = logits.float()
    if any(p.repetition_penalty != 1.0 for p in params) and seen is not None:
        repetition = _column(p.repetition_penalty for p in params)
        penalised = torch.where(scores < 0, scores * repetition, scores / repetition)
        scores = torch.where(seen, penalised, scores)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params) and counts is not None:
        counts = counts.to(scores.dtype)
        scores = (scores - _column(p.presence_penalty for p in params) * (counts > 0).to(scores.dtype)
                  - _column(p.frequency_penalty for p in params) * counts)
    if any(p.logit_bias for p in params):
        bias = torch.zeros_like(scores)
        for i, p in enumerate(params):
            for token_id, value in p.logit_bias:
                if 0 <= token_id < scores.shape[-1]:
                    bias[i, token_id] = value
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def full_sort_distribution(params: Sequence[SamplingParams], scores: torch.Tensor) -> torch.Tensor:
    """[sampled rows, vocab]: each sampled row's filtered probabilities in token-id order (not
    normalised after top-p, as the draw scales by the total) from its penalised `scores`."""
    rows = [i for i, p in enumerate(params) if p.do_sample]
    sampled, vocab = [params[i] for i in rows], scores.shape[-1]
    scores = scores[rows] / _column(max(p.temperature, 1e-5) for p in sampled)
    if any(p.min_p > 0 for p in sampled):
        probs = torch.softmax(scores, dim=-1)
        floor = _column(p.min_p for p in sampled) * probs.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, float("-inf"))
    typical = [j for j, p in enumerate(sampled) if p.typical_p < 1]
    if typical:
        scores[typical] = _typical(scores[typical], _column(sampled[j].typical_p for j in typical))
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in sampled])[:, None]
    probs = torch.softmax(ordered.masked_fill(ranks >= top_k, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= _column(p.top_p for p in sampled), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def full_sort_sample(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                     logits: torch.Tensor, seen=None, counts=None, allowed=None) -> list[int]:
    """The chosen token of every row: argmax for greedy rows, one draw from the row's generator
    inverted through its CDF in token-id order for sampled rows."""
    scores = penalised_scores(params, logits, seen, counts, allowed)
    chosen = scores.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.do_sample]
    if rows:
        cdf = full_sort_distribution(params, scores).cumsum(dim=-1)
        uniform = torch.stack([torch.rand((), generator=generators[r]) for r in rows])
        position = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:]).clamp(max=cdf.shape[-1] - 1)
        chosen[rows] = position.squeeze(-1)
    return chosen.tolist()
