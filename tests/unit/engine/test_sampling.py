"""HeterogeneousSampler: greedy/sampled rows side by side, per-row generators, filters, penalties, top-n."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lmi_serve.engine.sampling.sampler import HeterogeneousSampler, SampleOutput, _draw
from lmi_serve.engine.types import SamplingParams
from sampling_reference import full_sort_distribution, full_sort_sample, penalised_scores

CPU = torch.device("cpu")
VOCAB = 50
GREEDY = SamplingParams()


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def sampler(*params: SamplingParams, vocab: int = VOCAB, top_n=None) -> HeterogeneousSampler:
    return HeterogeneousSampler(list(params), CPU, vocab, top_n=top_n)


def draws(s: HeterogeneousSampler, logits: torch.Tensor, steps: int, row: int, **history) -> list[int]:
    return [s(logits, **history).token_ids[row] for _ in range(steps)]


def ids(s: HeterogeneousSampler, logits: torch.Tensor, **history) -> list[int]:
    return s(logits, **history).token_ids


def test_output_is_a_sample_output_with_python_values():
    out = sampler(GREEDY, SamplingParams(do_sample=True, seed=1))(random_logits(2))
    assert isinstance(out, SampleOutput)
    assert len(out.token_ids) == len(out.logprobs) == len(out.top) == 2
    assert all(isinstance(t, int) for t in out.token_ids)
    assert all(isinstance(lp, float) for lp in out.logprobs)
    assert out.top == [[], []]  # no top-n asked


def test_greedy_rows_are_argmax_and_logprob_is_raw_log_softmax():
    logits = random_logits(4)
    out = sampler(*[GREEDY] * 4)(logits)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)
    for row, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp == pytest.approx(expected[row, token].item(), abs=1e-5)
        assert lp <= 0


def test_sampled_logprob_is_from_raw_logits_not_tempered_or_filtered():
    logits = random_logits(1)
    s = sampler(SamplingParams(do_sample=True, temperature=0.3, top_k=5, top_p=0.8, typical_p=0.9, min_p=0.01,
                               seed=3))
    raw = torch.log_softmax(logits, -1)[0]
    for _ in range(20):
        out = s(logits)
        (token,), (lp,) = out.token_ids, out.logprobs
        assert lp == pytest.approx(raw[token].item(), abs=1e-5)


def test_half_precision_logits_are_accepted():
    logits = random_logits(2).to(torch.bfloat16)
    out = sampler(GREEDY, SamplingParams(do_sample=True, seed=1), top_n=[2, 2])(logits)
    assert out.token_ids[0] == logits.float().argmax(-1)[0].item()
    assert all(isinstance(lp, float) and math.isfinite(lp) for lp in out.logprobs)
    assert all(isinstance(lp, float) for row in out.top for _, lp in row)


def test_same_seed_gives_same_draws_regardless_of_other_rows_and_position():
    seeded = SamplingParams(do_sample=True, temperature=1.0, seed=1234)
    row_logits = random_logits(1, seed=7, scale=1.0)  # flat enough that draws vary

    alone = draws(sampler(seeded), row_logits, 30, row=0)
    assert len(set(alone)) > 3, "test premise: the distribution is wide enough to vary"

    others = random_logits(3, seed=99)
    batch = torch.cat([others[:2], row_logits, others[2:]])
    mixed = sampler(SamplingParams(do_sample=True, seed=5), GREEDY, seeded,
                    SamplingParams(do_sample=True, temperature=0.5, top_k=3, typical_p=0.5, min_p=0.2))
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


def test_explicit_generators_are_used():
    gen = torch.Generator().manual_seed(77)
    logits = random_logits(1, seed=7, scale=1.0)
    s = HeterogeneousSampler([SamplingParams(do_sample=True, seed=1)], CPU, VOCAB, generators=[gen])
    assert s.generators[0] is gen
    assert draws(s, logits, 10, 0) == draws(sampler(SamplingParams(do_sample=True, seed=77)), logits, 10, 0)


def test_greedy_row_next_to_sampled_rows_is_still_argmax():
    logits = random_logits(4, seed=3, scale=0.5)  # flat: sampled rows spread widely
    hot = SamplingParams(do_sample=True, temperature=5.0)
    s = sampler(hot, GREEDY, SamplingParams(do_sample=True, seed=9, top_k=10), GREEDY)
    best = logits.argmax(-1).tolist()
    sampled_draws = set()
    for _ in range(30):
        out = ids(s, logits)
        assert out[1] == best[1] and out[3] == best[3]
        sampled_draws.add(out[0])
    assert len(sampled_draws) > 3, "test premise: the hot row really samples"


def test_top_k_one_equals_greedy():
    logits = random_logits(3, scale=1.0)
    s = sampler(*[SamplingParams(do_sample=True, top_k=1, temperature=2.0, seed=i) for i in range(3)])
    for _ in range(10):
        assert ids(s, logits) == logits.argmax(-1).tolist()


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
        assert ids(s, logits) == logits.argmax(-1).tolist()


# probs 0.5, 0.3, 0.15, 0.05. Entropy H = 1.142 nats; surprises -log p = 0.69, 1.20, 1.90, 3.00;
# |surprise - H| = 0.45, 0.06, 0.76, 1.85: the most typical token is 1, then 0, 2, 3.
FOUR = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def test_top_p_keeps_the_smallest_nucleus():
    # top_p=0.7 keeps {0, 1} (0.5 < 0.7 so the second is needed).
    s = sampler(SamplingParams(do_sample=True, top_p=0.7, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 200, 0)) == {0, 1}
    # top_p=0.5 exactly: the mass before the second token already reaches 0.5 -> only the best.
    s = sampler(SamplingParams(do_sample=True, top_p=0.5, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 50, 0)) == {0}


def test_tiny_typical_p_keeps_only_the_most_typical_token():
    s = sampler(SamplingParams(do_sample=True, typical_p=1e-6, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 50, 0)) == {1}  # not the argmax: the token closest to the entropy


def test_tiny_typical_p_on_random_logits_matches_a_manual_computation():
    logits = random_logits(3, seed=5, scale=1.5)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
    expected = (-logp - entropy).abs().argmin(-1).tolist()
    assert expected != logits.argmax(-1).tolist(), "test premise: typical differs from argmax somewhere"
    s = sampler(*[SamplingParams(do_sample=True, typical_p=1e-6, seed=i) for i in range(3)])
    for _ in range(10):
        assert ids(s, logits) == expected


def test_typical_p_keeps_tokens_in_order_of_typicality_until_the_mass():
    # Typicality order 1 (0.3), 0 (0.5), 2 (0.15), 3: mass before 0 is 0.3, before 2 is 0.8.
    s = sampler(SamplingParams(do_sample=True, typical_p=0.5, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 200, 0)) == {0, 1}
    s = sampler(SamplingParams(do_sample=True, typical_p=0.25, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 50, 0)) == {1}
    s = sampler(SamplingParams(do_sample=True, typical_p=0.9, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 400, 0)) == {0, 1, 2}


def test_typical_p_one_is_a_no_op():
    plain = SamplingParams(do_sample=True, seed=42)
    neutral = SamplingParams(do_sample=True, seed=42, typical_p=1.0)
    logits = random_logits(1, seed=7, scale=1.0)
    assert sampler(neutral).typical_p is None
    expected = draws(sampler(plain), logits, 40, 0)
    assert draws(sampler(neutral), logits, 40, 0) == expected
    # Next to a row that does use typical_p, the neutral row still draws as if alone.
    mixed = sampler(SamplingParams(do_sample=True, typical_p=1e-6, seed=1), neutral)
    assert mixed.typical_p is not None
    got = [out[1] for out in (ids(mixed, torch.cat([logits, logits])) for _ in range(40))]
    assert got == expected


def test_min_p_close_to_one_keeps_only_the_argmax():
    logits = random_logits(3, scale=0.3)  # nearly flat
    s = sampler(*[SamplingParams(do_sample=True, min_p=0.999, temperature=3.0, seed=i) for i in range(3)])
    for _ in range(20):
        assert ids(s, logits) == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # min_p=0.5 -> floor 0.25: {0, 1}. min_p=0.2 -> floor 0.1: {0, 1, 2}.
    s = sampler(SamplingParams(do_sample=True, min_p=0.5, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 200, 0)) == {0, 1}
    s = sampler(SamplingParams(do_sample=True, min_p=0.2, seed=0), vocab=4)
    assert set(draws(s, FOUR.log(), 400, 0)) == {0, 1, 2}


def test_min_p_zero_is_a_no_op_and_per_row():
    logits = random_logits(1, seed=7, scale=1.0)
    neutral = SamplingParams(do_sample=True, seed=8, min_p=0.0)
    assert sampler(neutral).min_p is None
    expected = draws(sampler(neutral), logits, 40, 0)
    mixed = sampler(neutral, SamplingParams(do_sample=True, min_p=0.999, seed=1))
    outs = [ids(mixed, torch.cat([logits, logits])) for _ in range(40)]
    assert [o[0] for o in outs] == expected
    assert {o[1] for o in outs} == {logits.argmax().item()}


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


# -- penalties ---------------------------------------------------------------------------------


def test_repetition_penalty_makes_seen_argmax_lose():
    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0]])
    seen = torch.tensor([[True, False, False, False]])
    s = sampler(SamplingParams(repetition_penalty=2.0), vocab=4)
    assert s.needs_token_history
    out = s(logits, seen)
    assert out.token_ids == [1]  # 4 / 2 = 2 < 3
    # The logprob reported is still the model's own, unpenalised.
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item(), abs=1e-6)
    # Without `seen` or with nothing seen the argmax wins again.
    assert ids(s, logits, seen=torch.zeros_like(seen)) == [0]
    assert ids(s, logits) == [0]


def test_repetition_penalty_on_negative_logits_multiplies():
    # A seen negative logit gets more negative (times the penalty), so it must lose to an unseen one.
    logits = torch.tensor([[-1.0, -1.5, -9.0]])
    seen = torch.tensor([[True, False, False]])
    assert ids(sampler(SamplingParams(repetition_penalty=2.0), vocab=3), logits, seen=seen) == [1]
    # Penalty below 1 rewards seen tokens.
    logits = torch.tensor([[1.0, 1.5, -9.0]])
    assert ids(sampler(SamplingParams(repetition_penalty=0.5), vocab=3), logits, seen=seen) == [0]


def test_repetition_penalty_is_per_row_and_applies_to_sampled_rows():
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0], [5.0, 4.9, -5.0, -5.0], [20.0, 0.0, 0.0, 0.0]])
    seen = torch.tensor([[True, False, False, False]] * 3)
    s = sampler(GREEDY, SamplingParams(repetition_penalty=3.0),
                SamplingParams(do_sample=True, top_k=1, repetition_penalty=10.0, seed=0), vocab=4)
    # Row 0 has no penalty; row 1: 5/3 < 4.9; row 2 (sampled, top_k=1): 20/10 = 2 > 0 -> still 0.
    assert ids(s, logits, seen=seen) == [0, 1, 0]
    logits[2, 1] = 2.5
    assert ids(s, logits, seen=seen)[2] == 1


def test_no_penalty_means_no_token_history_needed():
    s = sampler(GREEDY, SamplingParams(do_sample=True, seed=0, repetition_penalty=1.0, presence_penalty=0.0,
                                       frequency_penalty=0.0))
    assert not s.needs_token_history
    assert s.repetition is None and s.presence is None and s.frequency is None
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=-0.5),
                   SamplingParams(repetition_penalty=1.1)):
        assert params.needs_penalties
        assert sampler(GREEDY, params).needs_token_history


PENALTY_LOGITS = torch.tensor([[4.0, 3.5, 3.0, 0.0]])


def counts_of(*values: int) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.int32)


def test_presence_penalty_lowers_a_generated_token_once():
    s = sampler(SamplingParams(presence_penalty=1.0), vocab=4)
    assert s.needs_token_history
    assert ids(s, PENALTY_LOGITS, counts=counts_of(0, 0, 0, 0)) == [0]
    assert ids(s, PENALTY_LOGITS, counts=counts_of(1, 0, 0, 0)) == [1]  # 4 - 1 = 3 < 3.5
    # Once, whatever the count: a presence of 0.4 never beats the 0.5 gap, even after 5 occurrences.
    weak = sampler(SamplingParams(presence_penalty=0.4), vocab=4)
    assert ids(weak, PENALTY_LOGITS, counts=counts_of(1, 0, 0, 0)) == [0]
    assert ids(weak, PENALTY_LOGITS, counts=counts_of(5, 0, 0, 0)) == [0]
    # Negative presence rewards generated tokens.
    assert ids(sampler(SamplingParams(presence_penalty=-2.0), vocab=4), PENALTY_LOGITS,
               counts=counts_of(0, 0, 1, 0)) == [2]


def test_frequency_penalty_scales_with_the_count():
    s = sampler(SamplingParams(frequency_penalty=0.3), vocab=4)
    assert ids(s, PENALTY_LOGITS, counts=counts_of(1, 0, 0, 0)) == [0]  # 3.7 > 3.5
    assert ids(s, PENALTY_LOGITS, counts=counts_of(2, 0, 0, 0)) == [1]  # 3.4 < 3.5
    assert ids(s, PENALTY_LOGITS, counts=counts_of(4, 2, 0, 0)) == [2]  # 2.8, 2.9 < 3.0
    # Presence and frequency add up: 4 - 0.2 - 0.2 = 3.6 > 3.5, 4 - 0.2 - 0.4 = 3.4 < 3.5.
    both = sampler(SamplingParams(presence_penalty=0.2, frequency_penalty=0.2), vocab=4)
    assert ids(both, PENALTY_LOGITS, counts=counts_of(1, 0, 0, 0)) == [0]
    assert ids(both, PENALTY_LOGITS, counts=counts_of(2, 0, 0, 0)) == [1]


def test_presence_and_frequency_are_per_row_and_keep_raw_logprobs():
    logits = PENALTY_LOGITS.repeat(4, 1)
    counts = counts_of(3, 0, 0, 0).repeat(4, 1)
    s = sampler(GREEDY, SamplingParams(presence_penalty=1.0), SamplingParams(frequency_penalty=0.0),
                SamplingParams(do_sample=True, top_k=1, frequency_penalty=1.0, seed=0), vocab=4)
    out = s(logits, counts=counts)
    assert out.token_ids == [0, 1, 0, 1]  # rows with 0 penalties are unaffected
    raw = torch.log_softmax(PENALTY_LOGITS, -1)[0]
    assert out.logprobs == pytest.approx([raw[t].item() for t in out.token_ids], abs=1e-6)


def test_presence_penalty_uses_generated_counts_not_prompt_tokens():
    # `seen` marks token 0 (a prompt token) but it was never generated: presence leaves it alone,
    # while the repetition penalty of another row does use `seen`.
    seen = torch.tensor([[True, False, False, False]] * 2)
    counts = torch.zeros((2, 4), dtype=torch.int32)
    s = sampler(SamplingParams(presence_penalty=5.0), SamplingParams(repetition_penalty=2.0), vocab=4)
    assert ids(s, PENALTY_LOGITS.repeat(2, 1), seen=seen, counts=counts) == [0, 1]


def test_repetition_then_presence_compose():
    # Token 0: 4 / 2 = 2 (repetition: seen) then - 0.5 (presence: generated once) = 1.5 < 1.6 (token 2).
    # Either penalty alone leaves token 0 ahead (2.0 or 3.5).
    logits = torch.tensor([[4.0, 1.0, 1.6, 0.0]])
    seen, counts = torch.tensor([[True, False, False, False]]), counts_of(1, 0, 0, 0)
    both = sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5), vocab=4)
    assert ids(both, logits, seen=seen, counts=counts) == [2]
    assert ids(sampler(SamplingParams(repetition_penalty=2.0), vocab=4), logits, seen=seen, counts=counts) == [0]
    assert ids(sampler(SamplingParams(presence_penalty=0.5), vocab=4), logits, seen=seen, counts=counts) == [0]


# -- top-n -------------------------------------------------------------------------------------


def test_top_n_lists_the_best_ids_by_logprob_per_row():
    logits = random_logits(3, seed=11)
    s = sampler(GREEDY, SamplingParams(do_sample=True, seed=2), GREEDY, top_n=[3, 0, 5])
    out = s(logits)
    logp = torch.log_softmax(logits, -1)
    assert [len(t) for t in out.top] == [3, 0, 5]
    for row, n in ((0, 3), (2, 5)):
        best = torch.topk(logp[row], n)
        assert [t for t, _ in out.top[row]] == best.indices.tolist()
        assert [lp for _, lp in out.top[row]] == pytest.approx(best.values.tolist(), abs=1e-6)
        values = [lp for _, lp in out.top[row]]
        assert values == sorted(values, reverse=True)
    # A greedy row's choice is its first alternative, with the same logprob.
    assert out.top[0][0] == (out.token_ids[0], pytest.approx(out.logprobs[0]))


def test_top_n_is_of_the_raw_distribution_not_the_penalised_one():
    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0]])
    s = sampler(SamplingParams(repetition_penalty=4.0), vocab=4, top_n=[2])
    out = s(logits, seen=torch.tensor([[True, False, False, False]]))
    assert out.token_ids == [1]
    assert [t for t, _ in out.top[0]] == [0, 1]


def test_top_n_follows_filter_and_extend():
    logits = random_logits(3, seed=12)
    s = sampler(GREEDY, GREEDY, top_n=[1, 0])
    s.extend(sampler(GREEDY, top_n=[4]))
    assert s.top_n == [1, 0, 4]
    assert [len(t) for t in s(logits).top] == [1, 0, 4]
    s.filter([2, 1])
    assert s.top_n == [4, 0] and s.max_top_n == 4
    out = s(logits[[2, 1]])
    assert [len(t) for t in out.top] == [4, 0]
    assert [t for t, _ in out.top[0]] == torch.topk(logits[2], 4).indices.tolist()
    s.filter([1])
    assert s.max_top_n == 0 and s(logits[1:2]).top == [[]]


# -- filter / extend ---------------------------------------------------------------------------


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
    assert not s.needs_token_history  # only row b had a penalty
    assert torch.equal(s.generators[0].get_state(), state_c)
    assert s.generators[1] is None

    # Row c continues exactly where it would have alone: one draw already consumed.
    ref = sampler(c)
    ref(logits[2:])
    expected = draws(ref, logits[2:], 10, 0)
    batch = torch.cat([logits[2:], logits[:1]])
    got = [ids(s, batch) for _ in range(10)]
    assert [g[0] for g in got] == expected
    assert all(g[1] == logits[0].argmax().item() for g in got)


def test_filter_keeps_penalty_of_remaining_rows():
    s = sampler(GREEDY, SamplingParams(repetition_penalty=2.0), GREEDY)
    s.filter([1])
    assert s.needs_token_history
    assert s.repetition.shape == (1, 1) and s.repetition.item() == 2.0
    logits = torch.tensor([[4.0, 3.0]])
    assert ids(s, logits, seen=torch.tensor([[True, False]])) == [1]
    s.filter([])
    assert s.params == [] and s.generators == [] and s.top_n == [] and not s.needs_token_history


def test_filter_keeps_presence_and_frequency_of_remaining_rows():
    s = sampler(SamplingParams(frequency_penalty=0.3), GREEDY, SamplingParams(presence_penalty=1.0), vocab=4)
    s.filter([2, 1])
    assert s.presence.flatten().tolist() == [1.0, 0.0] and s.frequency.flatten().tolist() == [0.0, 0.0]
    counts = counts_of(1, 0, 0, 0).repeat(2, 1)
    assert ids(s, PENALTY_LOGITS.repeat(2, 1), counts=counts) == [1, 0]
    s.filter([1])
    assert not s.needs_token_history


def test_filter_reorders():
    x = SamplingParams(do_sample=True, seed=1)
    y = SamplingParams(do_sample=True, seed=2)
    s = sampler(x, y)
    gx, gy = s.generators
    s.filter([1, 0])
    assert s.params == [y, x]
    assert s.generators[0] is gy and s.generators[1] is gx


def test_extend_then_filter_keeps_each_rows_generator_stream():
    a = SamplingParams(do_sample=True, seed=101)
    b = SamplingParams(do_sample=True, seed=202, temperature=0.7, top_k=20)
    c = SamplingParams(do_sample=True, seed=303, min_p=0.05)
    logits = random_logits(1, seed=7, scale=1.0)

    def reference(params: SamplingParams, skip: int, n: int) -> list[int]:
        ref = sampler(params)
        draws(ref, logits, skip, 0)
        return draws(ref, logits, n, 0)

    first = sampler(a, GREEDY)
    draws(first, logits.repeat(2, 1), 3, 0)  # a: 3 draws consumed
    second = sampler(b, c)
    draws(second, logits.repeat(2, 1), 1, 0)  # b and c: 1 draw each consumed

    first.extend(second)
    assert first.params == [a, GREEDY, b, c]
    assert first.sample_rows == [0, 2, 3] and first.greedy_rows == [1]
    outs = [ids(first, logits.repeat(4, 1)) for _ in range(5)]  # a: 8, b and c: 6
    assert [o[0] for o in outs] == reference(a, 3, 5)
    assert [o[2] for o in outs] == reference(b, 1, 5)
    assert [o[3] for o in outs] == reference(c, 1, 5)
    assert {o[1] for o in outs} == {logits.argmax().item()}

    first.filter([3, 0])  # c, a
    outs = [ids(first, logits.repeat(2, 1)) for _ in range(10)]
    assert [o[0] for o in outs] == reference(c, 6, 10)
    assert [o[1] for o in outs] == reference(a, 8, 10)


def test_extend_rebuilds_parameter_tensors():
    s = sampler(GREEDY)
    assert not s.needs_token_history and s.typical_p is None
    s.extend(sampler(SamplingParams(do_sample=True, typical_p=0.5, seed=1, presence_penalty=0.5)))
    assert s.needs_token_history and s.typical_p is not None
    assert s.presence.flatten().tolist() == [0.0, 0.5]
    assert s.sample_rows == [1] and s.greedy_rows == [0]


# -- candidate sets against the full sort (sampling_reference.py: the sampler before them) ---------


def lean_distribution(s: HeterogeneousSampler, scores: torch.Tensor) -> torch.Tensor:
    """[sampled rows, vocab]: the sampler's filtered probabilities in token-id order."""
    out = torch.zeros((len(s.sample_rows), scores.shape[-1]))
    for rows, probs, ids in s._distributions(scores):
        out[rows] = probs if ids is None else torch.zeros_like(out[rows]).scatter_(-1, ids, probs)
    return out


def assert_same_distributions(params, s: HeterogeneousSampler, logits, **history):
    """Top-k rows: the full sort's probabilities bit for bit. Rows whose probabilities are over the
    whole vocabulary: up to its normaliser's rounding (summed in id order, not in sorted order)."""
    scores = penalised_scores(params, logits, **history)
    lean, full = lean_distribution(s, scores), full_sort_distribution(params, scores)
    vocab = logits.shape[-1]
    for j, row in enumerate(s.sample_rows):
        p = params[row]
        if 0 < p.top_k < vocab:
            assert torch.equal(lean[j], full[j]), f"row {row}: {p}"
        else:
            distance = (lean[j] / lean[j].sum() - full[j] / full[j].sum()).abs().sum().item() / 2
            assert distance < 1e-5, f"row {row}: total variation {distance}: {p}"


def assert_same_draws(params, s: HeterogeneousSampler, logits, steps: int = 5, **history):
    generators = [None if not p.do_sample else torch.Generator().manual_seed(p.seed) for p in params]
    for _ in range(steps):
        assert s(logits, **history).token_ids == full_sort_sample(params, generators, logits, **history)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    if rng.random() < 0.2:
        return SamplingParams(repetition_penalty=rng.choice([1.0, 1.3]), logit_bias=rng.choice([(), ((3, 9.0),)]))
    return SamplingParams(
        do_sample=True, seed=rng.randrange(1 << 30), temperature=rng.choice([0.3, 0.7, 1.0, 1.8]),
        top_k=rng.choice([0, 0, 1, 5, 40, 300, vocab - 1, vocab + 10]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.95, 0.999]), min_p=rng.choice([0.0, 0.0, 0.05]),
        typical_p=rng.choice([1.0, 1.0, 1.0, 0.9]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.3]),
        logit_bias=rng.choice([(), ((3, 5.0), (7, -100.0))]))


@pytest.mark.parametrize("case", range(24))
def test_candidate_sets_choose_as_the_full_sort_for_random_parameter_mixes(case):
    rng, vocab = random.Random(case), 3000
    gen = torch.Generator().manual_seed(case)
    rows = rng.choice([1, 3, 8])
    params = [random_params(rng, vocab) for _ in range(rows)]
    logits = torch.randn(rows, vocab, generator=gen) * rng.choice([1.0, 3.0, 6.0])
    if case % 3 == 0:  # bf16 logits: many equal scores, at the top-k and top-p boundaries too
        logits = logits.to(torch.bfloat16).float()
    history = {"seen": torch.rand(rows, vocab, generator=gen) < 0.05,
               "counts": (torch.rand(rows, vocab, generator=gen) < 0.02).int() * 2}
    if case % 4 == 1:
        history["allowed"] = torch.rand(rows, vocab, generator=gen) < 0.7
    s = sampler(*params, vocab=vocab)
    if s.sample_rows:
        assert_same_distributions(params, s, logits, **history)
    assert_same_draws(params, s, logits, steps=3, **history)


def test_vocabulary_size_logits_choose_as_the_full_sort():
    vocab = 49152
    logits = random_logits(4, vocab, seed=5, scale=3.0)
    params = [SamplingParams(do_sample=True, seed=1, top_p=0.9), SamplingParams(do_sample=True, seed=2, top_k=50),
              SamplingParams(do_sample=True, seed=3, top_k=50, top_p=0.9, temperature=0.7), GREEDY]
    s = sampler(*params, vocab=vocab)
    assert_same_distributions(params, s, logits)
    assert_same_draws(params, s, logits)


def widths(monkeypatch, s: HeterogeneousSampler, logits: torch.Tensor) -> list[tuple[str, int, int]]:
    """The torch.topk and torch.sort calls (rows, width) of one step of `s`, which draws nothing."""
    calls = []

    def spy(name, original):
        def call(input, *args, **kwargs):
            calls.append((name, input.shape[0], args[0] if name == "topk" else input.shape[-1]))
            return original(input, *args, **kwargs)
        return call

    with monkeypatch.context() as patch:
        for name in ("topk", "sort"):
            patch.setattr(torch, name, spy(name, getattr(torch, name)))
        s._distributions(logits)
    return calls


def test_a_nucleus_wider_than_the_candidates_widens_then_sorts_its_row(monkeypatch):
    vocab = 20000
    logits = torch.cat([random_logits(1, vocab, seed=1, scale=0.05),  # flat: a 0.9 nucleus of ~18000 tokens
                        random_logits(1, vocab, seed=2, scale=3.0),  # a nucleus of ~900 tokens
                        random_logits(1, vocab, seed=3, scale=6.0)])  # a nucleus of a few tokens
    params = [SamplingParams(do_sample=True, seed=i, top_p=0.9) for i in range(3)]
    s = sampler(*params, vocab=vocab)
    # The flat row's 256 candidates show it needs over 2048: it goes straight to the sort.
    assert widths(monkeypatch, s, logits) == [("topk", 3, 256), ("topk", 1, 2048), ("sort", 1, vocab)]
    assert_same_distributions(params, s, logits)
    assert_same_draws(params, s, logits, steps=20)


def test_equal_scores_across_the_top_k_boundary_are_left_to_the_full_sort(monkeypatch):
    vocab = 20000
    logits = torch.arange(vocab, dtype=torch.float32).div(4000).floor()[None, :]  # five runs of 4000 equal scores
    params = [SamplingParams(do_sample=True, seed=7, top_k=100)]
    s = sampler(*params, vocab=vocab)
    # No candidate set can tell which of the 4000 best the sort puts first: straight to the sort.
    assert widths(monkeypatch, s, logits) == [("topk", 1, 101), ("sort", 1, vocab)]
    assert_same_distributions(params, s, logits)
    assert_same_draws(params, s, logits, steps=20)


@pytest.mark.parametrize("tie", [False, True])
def test_a_nucleus_ending_at_the_last_candidate_looks_at_the_next_token(monkeypatch, tie):
    # 257 strong tokens at shuffled ids, the rest far below; top_p ends the nucleus at the 256th,
    # so the candidates alone cannot tell whether the 257th scores the same (then the sort decides).
    vocab, gen = 20000, torch.Generator().manual_seed(3)
    best = torch.linspace(5.0, 3.0, 257)
    best[256] = best[255] if tie else best[255] - 0.01
    logits = torch.full((1, vocab), -20.0)
    logits[0, torch.randperm(vocab, generator=gen)[:257]] = best
    mass = torch.softmax(logits[0], -1).sort(descending=True).values.cumsum(-1)
    params = [SamplingParams(do_sample=True, seed=5, top_p=(mass[254] + mass[255]).item() / 2)]
    s = sampler(*params, vocab=vocab)
    expected = [("topk", 1, 256), ("topk", 1, 2048)] + ([("sort", 1, vocab)] if tie else [])
    assert widths(monkeypatch, s, logits) == expected
    assert_same_distributions(params, s, logits)
    assert (lean_distribution(s, logits) > 0).sum() == 256
    assert_same_draws(params, s, logits, steps=20)


def test_rows_without_top_k_or_top_p_sort_nothing(monkeypatch):
    s = sampler(GREEDY, SamplingParams(do_sample=True, seed=1, temperature=0.8), SamplingParams(do_sample=True))
    assert widths(monkeypatch, s, random_logits(3)) == []


def test_a_seeded_row_draws_the_same_whatever_candidate_width_the_batch_gives():
    vocab, steps = 3000, 12
    row = random_logits(1, vocab, seed=11, scale=1.5)
    nucleus = SamplingParams(do_sample=True, seed=21, top_p=0.9, temperature=1.2)
    top_k = SamplingParams(do_sample=True, seed=22, top_k=30, top_p=0.95)
    alone = {p.seed: draws(sampler(p, vocab=vocab), row, steps, 0) for p in (nucleus, top_k)}
    assert len(set(alone[21])) > 3, "test premise: the row really samples"
    others = [SamplingParams(do_sample=True, seed=1, top_k=2000),  # 2001 candidates for everyone
              SamplingParams(do_sample=True, seed=2, typical_p=0.5, min_p=0.1),
              SamplingParams(do_sample=True, seed=3, top_p=0.99), GREEDY]
    batch = torch.cat([row, random_logits(len(others), vocab, seed=12, scale=0.05)])  # flat rows: widen, sort
    for own in (nucleus, top_k):
        for other in others:
            mixed = sampler(own, other, vocab=vocab)
            assert draws(mixed, batch[:2], steps, 0) == alone[own.seed], other
        assert draws(sampler(own, *others, vocab=vocab), batch, steps, 0) == alone[own.seed]


def test_a_draw_of_zero_picks_a_kept_token():
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5]])
    assert _draw(probs, torch.tensor([0.0]), None).tolist() == [2]
    assert _draw(probs, torch.tensor([0.0]), torch.tensor([[9, 8, 7, 6, 5]])).tolist() == [5]
    assert _draw(probs, torch.tensor([0.9]), torch.tensor([[9, 8, 7, 6, 5]])).tolist() == [7]
