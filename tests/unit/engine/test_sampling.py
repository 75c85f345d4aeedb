"""HeterogeneousSampler: greedy/sampled rows side by side, per-row generators, filters, penalty."""

from __future__ import annotations

import math

import pytest
import torch

from lmi_serve.engine.sampling import HeterogeneousSampler
from lmi_serve.engine.types import SamplingParams

CPU = torch.device("cpu")
VOCAB = 50
GREEDY = SamplingParams()


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def sampler(*params: SamplingParams, vocab: int = VOCAB) -> HeterogeneousSampler:
    return HeterogeneousSampler(list(params), CPU, vocab)


def draws(s: HeterogeneousSampler, logits: torch.Tensor, steps: int, row: int) -> list[int]:
    return [s(logits)[0][row] for _ in range(steps)]


def test_greedy_rows_are_argmax_and_logprob_is_raw_log_softmax():
    logits = random_logits(4)
    ids, logprobs = sampler(*[GREEDY] * 4)(logits)
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)
    for row, (token, lp) in enumerate(zip(ids, logprobs)):
        assert lp == pytest.approx(expected[row, token].item(), abs=1e-5)
        assert lp <= 0


def test_sampled_logprob_is_from_raw_logits_not_tempered_or_filtered():
    logits = random_logits(1)
    s = sampler(SamplingParams(do_sample=True, temperature=0.3, top_k=5, top_p=0.8, seed=3))
    raw = torch.log_softmax(logits, -1)[0]
    for _ in range(20):
        (token,), (lp,) = s(logits)
        assert lp == pytest.approx(raw[token].item(), abs=1e-5)


def test_half_precision_logits_are_accepted():
    logits = random_logits(2).to(torch.bfloat16)
    ids, logprobs = sampler(GREEDY, SamplingParams(do_sample=True, seed=1))(logits)
    assert ids[0] == logits.float().argmax(-1)[0].item()
    assert all(isinstance(lp, float) and math.isfinite(lp) for lp in logprobs)


def test_same_seed_gives_same_draws_regardless_of_other_rows_and_position():
    seeded = SamplingParams(do_sample=True, temperature=1.0, seed=1234)
    row_logits = random_logits(1, seed=7, scale=1.0)  # flat enough that draws vary

    alone = draws(sampler(seeded), row_logits, 30, row=0)
    assert len(set(alone)) > 3, "test premise: the distribution is wide enough to vary"

    others = random_logits(3, seed=99)
    batch = torch.cat([others[:2], row_logits, others[2:]])
    mixed = sampler(SamplingParams(do_sample=True, seed=5), GREEDY, seeded,
                    SamplingParams(do_sample=True, temperature=0.5, top_k=3))
    assert draws(mixed, batch, 30, row=2) == alone


def test_different_seeds_differ():
    logits = random_logits(1, seed=7, scale=1.0)
    a = draws(sampler(SamplingParams(do_sample=True, seed=1)), logits, 30, 0)
    b = draws(sampler(SamplingParams(do_sample=True, seed=2)), logits, 30, 0)
    assert a != b


def test_unseeded_rows_get_fresh_generators():
    logits = random_logits(1, seed=7, scale=1.0)
    a = draws(sampler(SamplingParams(do_sample=True)), logits, 30, 0)
    b = draws(sampler(SamplingParams(do_sample=True)), logits, 30, 0)
    assert a != b


def test_greedy_rows_have_no_generator():
    s = sampler(GREEDY, SamplingParams(do_sample=True, seed=0))
    assert s.generators[0] is None
    assert isinstance(s.generators[1], torch.Generator)
    assert s.greedy_rows == [0] and s.sample_rows == [1]


def test_top_k_one_equals_greedy():
    logits = random_logits(3, scale=1.0)
    s = sampler(*[SamplingParams(do_sample=True, top_k=1, temperature=2.0, seed=i) for i in range(3)])
    for _ in range(10):
        assert s(logits)[0] == logits.argmax(-1).tolist()


def test_top_k_restricts_to_k_best():
    logits = random_logits(1, scale=0.5)
    allowed = set(torch.topk(logits[0], 4).indices.tolist())
    s = sampler(SamplingParams(do_sample=True, top_k=4, seed=11))
    seen = set(draws(s, logits, 200, 0))
    assert seen <= allowed
    assert len(seen) > 1


def test_tiny_top_p_keeps_only_best_token():
    logits = random_logits(2, scale=0.3)  # nearly flat: without top_p, draws would spread widely
    s = sampler(*[SamplingParams(do_sample=True, top_p=1e-6, temperature=5.0, seed=i) for i in range(2)])
    for _ in range(20):
        assert s(logits)[0] == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1} (0.5 < 0.7 so the second is needed).
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    s = sampler(SamplingParams(do_sample=True, top_p=0.7, seed=0), vocab=4)
    seen = set(draws(s, probs.log(), 200, 0))
    assert seen == {0, 1}
    # top_p=0.5 exactly: the mass before the second token already reaches 0.5 -> only the best.
    s = sampler(SamplingParams(do_sample=True, top_p=0.5, seed=0), vocab=4)
    assert set(draws(s, probs.log(), 50, 0)) == {0}


def test_low_temperature_concentrates_high_temperature_spreads():
    logits = random_logits(1, scale=1.0)
    best = logits.argmax(-1).item()
    n = 400
    cold = draws(sampler(SamplingParams(do_sample=True, temperature=0.05, seed=1)), logits, n, 0)
    warm = draws(sampler(SamplingParams(do_sample=True, temperature=1.0, seed=1)), logits, n, 0)
    hot = draws(sampler(SamplingParams(do_sample=True, temperature=10.0, seed=1)), logits, n, 0)
    assert cold.count(best) / n > 0.95
    assert cold.count(best) > warm.count(best) > hot.count(best)
    assert len(set(cold)) < len(set(warm)) < len(set(hot))


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = torch.softmax(logits, -1)[0]
    n = 4000
    counts = torch.bincount(torch.tensor(draws(sampler(SamplingParams(do_sample=True, seed=0), vocab=4),
                                               logits, n, 0)), minlength=4).float() / n
    assert torch.allclose(counts, expected, atol=0.03)


def test_repetition_penalty_makes_seen_argmax_lose():
    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0]])
    seen = torch.tensor([[True, False, False, False]])
    s = sampler(SamplingParams(repetition_penalty=2.0), vocab=4)
    assert s.needs_seen_tokens
    ids, logprobs = s(logits, seen)
    assert ids == [1]  # 4 / 2 = 2 < 3
    # The logprob reported is still the model's own, unpenalised.
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item(), abs=1e-6)
    # Without `seen` or with nothing seen the argmax wins again.
    assert s(logits, torch.zeros_like(seen))[0] == [0]


def test_repetition_penalty_on_negative_logits_multiplies():
    # A seen negative logit gets more negative (times the penalty), so it must lose to an unseen one.
    logits = torch.tensor([[-1.0, -1.5, -9.0]])
    seen = torch.tensor([[True, False, False]])
    assert sampler(SamplingParams(repetition_penalty=2.0), vocab=3)(logits, seen)[0] == [1]
    # Penalty below 1 rewards seen tokens.
    logits = torch.tensor([[1.0, 1.5, -9.0]])
    assert sampler(SamplingParams(repetition_penalty=0.5), vocab=3)(logits, seen)[0] == [0]


def test_repetition_penalty_is_per_row_and_applies_to_sampled_rows():
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0], [5.0, 4.9, -5.0, -5.0], [20.0, 0.0, 0.0, 0.0]])
    seen = torch.tensor([[True, False, False, False]] * 3)
    s = sampler(GREEDY, SamplingParams(repetition_penalty=3.0),
                SamplingParams(do_sample=True, top_k=1, repetition_penalty=10.0, seed=0), vocab=4)
    ids, _ = s(logits, seen)
    # Row 0 has no penalty; row 1: 5/3 < 4.9; row 2 (sampled, top_k=1): 20/10 = 2 > 0 -> still 0.
    assert ids == [0, 1, 0]
    logits[2, 1] = 2.5
    assert s(logits, seen)[0][2] == 1


def test_no_penalty_means_no_seen_tokens_needed():
    s = sampler(GREEDY, SamplingParams(do_sample=True, seed=0, repetition_penalty=1.0))
    assert not s.needs_seen_tokens
    assert s.penalty is None


def test_filter_keeps_the_right_rows_generators_and_params():
    a = SamplingParams(do_sample=True, seed=10)
    b = SamplingParams(do_sample=True, seed=20, repetition_penalty=1.3)
    c = SamplingParams(do_sample=True, seed=30)
    logits = random_logits(3, seed=4, scale=1.0)
    s = sampler(a, b, GREEDY, c)
    s(torch.cat([logits[:2], logits[:1], logits[2:]]), torch.zeros(4, VOCAB, dtype=torch.bool))
    state_c = s.generators[3].get_state()

    s.filter([3, 2])
    assert s.params == [c, GREEDY]
    assert s.sample_rows == [0] and s.greedy_rows == [1]
    assert not s.needs_seen_tokens  # only row b had a penalty
    assert torch.equal(s.generators[0].get_state(), state_c)
    assert s.generators[1] is None

    # Row c continues exactly where it would have alone: one draw already consumed.
    ref = sampler(c)
    ref(logits[2:])
    expected = draws(ref, logits[2:], 10, 0)
    batch = torch.cat([logits[2:], logits[:1]])
    got = [s(batch)[0] for _ in range(10)]
    assert [g[0] for g in got] == expected
    assert all(g[1] == logits[0].argmax().item() for g in got)


def test_filter_keeps_penalty_of_remaining_rows():
    s = sampler(GREEDY, SamplingParams(repetition_penalty=2.0), GREEDY)
    s.filter([1])
    assert s.needs_seen_tokens
    assert s.penalty.shape == (1, 1) and s.penalty.item() == 2.0
    logits = torch.tensor([[4.0, 3.0]])
    assert s(logits, torch.tensor([[True, False]]))[0] == [1]
    s.filter([])
    assert s.params == [] and s.generators == [] and not s.needs_seen_tokens


def test_filter_reorders():
    x = SamplingParams(do_sample=True, seed=1)
    y = SamplingParams(do_sample=True, seed=2)
    s = sampler(x, y)
    gx, gy = s.generators
    s.filter([1, 0])
    assert s.params == [y, x]
    assert s.generators[0] is gy and s.generators[1] is gx
