"""Ranking a request's sequences (n, best_of): LMI's and TGI's routes show the best first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lmi_serve.dialects.common.shapes import RenderContext
from lmi_serve.engine.types import GenerationRequest, GenerationResult


def best_first(results: Sequence[GenerationResult], n: int) -> list[GenerationResult]:
    """Sequences by cumulative logprob, best first: the best `n` when n > 1 (vLLM's n of best_of),
    else all of them (TGI's best_of: the others become best_of_sequences)."""
    return [results[i] for i in _ranking(results, n)]


def _ranking(results: Sequence[GenerationResult], n: int) -> list[int]:
    """The indices of `results` in `best_first` order."""
    ranked = sorted(range(len(results)), key=lambda i: results[i].cumulative_logprob, reverse=True)
    return ranked[:n] if n > 1 else ranked


def rank_with_seeds(ctx: RenderContext, requests: Sequence[GenerationRequest], results: Sequence[GenerationResult],
                    n: int) -> tuple[RenderContext, list[GenerationResult]]:
    """`best_first(results, n)`, and `ctx` reporting each ranked sequence's own sampling seed
    (`requests[i]` produced `results[i]`): the best one's as `seed`, the others' as `other_seeds`."""
    order = _ranking(results, n)
    seeds = [requests[i].sampling.seed for i in order]
    return replace(ctx, seed=seeds[0], other_seeds=tuple(seeds[1:])), [results[i] for i in order]
