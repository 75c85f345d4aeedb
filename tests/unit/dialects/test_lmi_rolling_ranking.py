"""Ranking a request's sequences keeps each one's own sampling seed with it (TGI best_of_sequences)."""

from __future__ import annotations

from types import SimpleNamespace

from lmi_serve.dialects.lmi.formatters import RenderContext
from lmi_serve.dialects.lmi.rolling import rank_with_seeds
from lmi_serve.engine.types import FinishReason, GenerationResult, TokenEvent


def result(logprob: float) -> GenerationResult:
    return GenerationResult(1, [TokenEvent(5, "x", logprob, False, FinishReason.LENGTH)])


def request(seed: int | None) -> SimpleNamespace:
    return SimpleNamespace(sampling=SimpleNamespace(seed=seed))


def test_each_ranked_sequence_reports_the_seed_it_was_sampled_with():
    results = [result(-3.0), result(-1.0), result(-2.0)]
    requests = [request(100), request(101), request(102)]
    ctx, ranked = rank_with_seeds(RenderContext("p", tgi_compat=True, seed=100), requests, results, n=1)
    assert ranked == [results[1], results[2], results[0]]
    assert ctx.seed == 101 and ctx.other_seeds == (102, 100)


def test_n_keeps_the_best_n_with_their_seeds():
    results = [result(-3.0), result(-1.0), result(-2.0)]
    ctx, ranked = rank_with_seeds(RenderContext("p", seed=7), [request(7), request(8), request(9)], results, n=2)
    assert ranked == [results[1], results[2]]
    assert ctx.seed == 8 and ctx.other_seeds == (9,)
