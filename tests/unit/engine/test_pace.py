"""The step pace (engine/pace.py): a step's prompt-token budget from a bound on its seconds, fitted to
the steps' measured costs; and the scheduler's use of it (what it reports, what it admits)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from lmi_serve.engine import pace as pace_module
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.pace import MIN_TOKENS, StepPace, StepWork, prompt_work
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
from waiting import within

CPU = torch.device("cpu")


def machine(k: float, a: float, noise: float = 0.0, seed: int = 0):
    """Step costs of a made-up machine: 10 ms + 2 ms a decode row + 1 us a context token + k a prompt
    token + a an attention pair, times up to 1 +- noise."""
    rng = random.Random(seed)

    def seconds(work: StepWork) -> float:
        exact = 0.01 + 0.002 * work.rows + 1e-6 * work.context + k * work.prompt_tokens + a * work.attention_pairs
        return exact * (1 + rng.uniform(-noise, noise))
    return seconds


def workload(steps: int, seed: int = 1):
    """Steps as a served load makes them: 1-32 rows, some with joiners, some with a long prompt's chunk."""
    rng = random.Random(seed)
    for _ in range(steps):
        rows = rng.randint(1, 32)
        context = rows * rng.randint(20, 400)
        kind = rng.random()
        if kind < 0.4:
            yield StepWork(rows, context, 0, 0.0)
        elif kind < 0.8:
            n = rng.randint(10, 200)
            yield StepWork(rows, context, n, prompt_work(0, n))
        else:
            done, n = rng.randint(0, 1900), rng.randint(40, 256)
            yield StepWork(rows, context, n, prompt_work(done, n))


def fed(pace: StepPace, cost, steps: int) -> StepPace:
    for work in workload(steps):
        pace.observe(work, cost(work))
    return pace


def test_the_fit_finds_the_decode_a_prompt_tokens_cost_and_the_attention_crossover():
    k, a = 1.6e-3, 1.6e-3 / 1500  # a prompt token 1.6 ms; its attention as dear as that at 1,500 tokens in
    pace = fed(StepPace(0.25, prior_crossover=3072), machine(k, a, noise=0.05), 200)
    assert pace.token_seconds == pytest.approx(k, rel=0.05)
    assert pace.crossover == pytest.approx(1500, rel=0.15)
    decode = 0.01 + 0.002 * 32 + 1e-6 * 6400  # 80 ms: 32 rows of 200 tokens
    assert pace.decode_seconds(32, 6400) == pytest.approx(decode, rel=0.1)
    assert pace.tokens(256, 32, 6400) == pytest.approx((0.25 - decode) / k, abs=8)  # 106: what the decode leaves
    assert pace.tokens(256, 0, 0) == pytest.approx((0.25 - 0.01) / k, abs=8)  # 150 with no running rows
    assert pace.tokens(100, 0, 0) == 100  # never over the token budget


def test_a_fast_machine_keeps_the_token_budget_and_a_slow_one_still_advances():
    fast = fed(StepPace(0.25, prior_crossover=3072), machine(2e-4, 2e-4 / 3000), 100)
    assert fast.tokens(256, 32, 6400) == 256
    slow = fed(StepPace(0.25, prior_crossover=3072), machine(0.05, 0.0), 100)  # 50 ms a token
    assert slow.tokens(256, 0, 0) == MIN_TOKENS  # 0.25 s holds 4 tokens: the floor, so prompts still advance
    assert slow.tokens(256, 200, 10**5) == MIN_TOKENS  # a decode over the bound alone: the floor too
    assert slow.tokens(8, 0, 0) == 8


def test_nothing_changes_until_enough_steps_with_prefills_were_seen():
    pace = StepPace(0.25, prior_crossover=3072)
    cost = machine(1.6e-3, 1e-6)
    for _ in range(pace_module.MIN_STEPS * 2):  # decodes only: a prompt token's cost cannot be told
        work = StepWork(16, 3200, 0, 0.0)
        pace.observe(work, cost(work))
    assert pace.token_seconds is None and pace.tokens(256, 16, 3200) == 256 and pace.crossover == 3072
    fed(pace, cost, pace_module.MIN_STEPS)
    assert pace.token_seconds is not None and pace.tokens(256, 16, 3200) < 256


def test_a_fit_that_finds_prompt_tokens_free_is_not_trusted():
    pace = fed(StepPace(0.25, prior_crossover=3072), lambda work: 0.05 - 1e-5 * work.prompt_tokens, 100)
    assert pace.token_seconds is None and pace.tokens(256, 16, 3200) == 256


def test_a_fit_without_attention_cost_keeps_the_models_crossover():
    pace = fed(StepPace(0.25, prior_crossover=3072), machine(1e-3, -1e-7), 100)
    assert pace.token_seconds == pytest.approx(1e-3, rel=0.05) and pace.crossover == 3072


@pytest.mark.parametrize("seed", [1, 3])
def test_prompts_of_one_length_on_a_noisy_machine_still_fit_a_step_to_its_seconds(seed):
    """Chat prompts of one length (guidellm's): their tokens and attention pairs move together, so a noisy
    machine's steps (+-30 %, one in ten stalled to twice its time) can fit any split of the two; the crossover
    stays where it is believed and a step still lands near its bound (unbounded: crossovers of ~200 tokens
    and steps 1.23-1.28x the bound with these seeds)."""
    k, a = 1.6e-3, 1.6e-3 / 1500
    exact, rng = machine(k, a), random.Random(seed)
    pace = StepPace(0.25, prior_crossover=3072)
    for _ in range(200):
        rows = rng.randint(20, 32)
        context = rows * rng.randint(130, 200)
        done, n = rng.choice([(0, 130), (16, 114), (0, 0)])  # a miss, a prefix-cache hit, a decode
        work = StepWork(rows, context, n, prompt_work(done, n))
        pace.observe(work, exact(work) * rng.uniform(0.7, 1.3) * (2 if rng.random() < 0.1 else 1))
    assert pace.crossover >= 3072 / pace_module.CROSSOVER_RANGE
    budget = pace.tokens(256, 28, 28 * 160)
    step = exact(StepWork(28, 28 * 160, budget, prompt_work(16, budget)))
    assert budget < 256 and 0.8 * 0.25 <= step <= 1.15 * 0.25, (budget, step)


def test_what_ran_since_the_last_delivery_counts_against_the_step():
    now = [0.0]
    pace = StepPace(0.25, prior_crossover=3072, clock=lambda: now[0])
    cost = machine(1.6e-3, 1.6e-3 / 1500)
    for work in workload(100):
        pace.observe(work, cost(work))  # each delivered at 0 s
    fresh = pace.tokens(256, 32, 6400)
    now[0] = 0.1  # a beam search's step took 0.1 s after the delivery
    assert pace.tokens(256, 32, 6400) == pytest.approx(fresh - 0.1 / 1.6e-3, abs=2)  # 62 tokens fewer
    assert pace.tokens(256, 0, 0) == pytest.approx(0.24 / 1.6e-3, abs=8)  # no running rows: no gap to keep
    now[0] = 5.0
    assert pace.tokens(256, 32, 6400) == MIN_TOKENS


def test_seconds_must_be_positive():
    with pytest.raises(ValueError, match="seconds > 0"):
        StepPace(0, prior_crossover=3072)


# -- the scheduler's use of it ------------------------------------------------------------------------
class FixedPace(StepPace):
    """A pace whose budget is `budget` tokens and that records what the scheduler tells it."""

    def __init__(self, budget: int, crossover: float):
        ticks = itertools.count()
        super().__init__(1.0, prior_crossover=crossover, clock=lambda: float(next(ticks)))
        self.budget, self.seen = budget, []

    def tokens(self, most: int, rows: int, context: int) -> int:
        return min(self.budget, most)

    def observe(self, work: StepWork, seconds: float) -> None:
        self.seen.append((work, seconds))


def greedy(prompt, n: int) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def ids(result) -> list[int]:
    assert result.error is None, result.error
    return [e.token_id for e in result.events]


@pytest.mark.parametrize("mixed", [True, False])
def test_the_scheduler_admits_the_paced_budget_and_reports_each_steps_work(mixed, tiny_model, smollm2_tokenizer):
    generator = torch.Generator().manual_seed(5)
    first = len(smollm2_tokenizer.all_special_ids) + 1
    prompts = [torch.randint(first, len(smollm2_tokenizer), (n,), generator=generator).tolist() for n in (6, 9, 70)]

    def run(pace: StepPace | None) -> list[list[int]]:
        engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=256,
                        mixed_steps=mixed)
        engine.scheduler.pace = pace
        short = engine.generate([greedy(prompts[0], 30)])
        engine.scheduler.step()  # a running row, so later prompts join it (a mixed step where it mixes)
        rest = engine.generate([greedy(p, 4) for p in prompts[1:]])
        while not engine.scheduler.idle:
            engine.scheduler.step()
        return [ids(r) for r in within(lambda: [*short.results(), *rest.results()])]

    crossover = 1e9  # no attention weighting: chunks are the budget's size
    pace = FixedPace(12, crossover)
    assert run(pace) == run(None)  # the budget moves latency, never what is generated
    total = sum(len(p) for p in prompts)
    assert sum(work.prompt_tokens for work, _ in pace.seen) == total  # every prompt token reported once
    assert all(work.prompt_tokens <= 12 for work, _ in pace.seen)  # each step within the paced budget
    chunks = [work for work, _ in pace.seen if work.prompt_tokens and work.rows]
    assert len(chunks) >= 70 // 12  # the 70-token prompt went in budget-sized chunks beside the running row
    # A prompt's tokens each attend over those before them, however it was cut: n^2 / 2 pairs in all.
    assert sum(work.attention_pairs for work, _ in pace.seen) == sum(len(p) ** 2 / 2 for p in prompts)
    assert all(seconds == 1.0 for _, seconds in pace.seen)  # timed by the pace's clock
    assert all((work.context > 0) == (work.rows > 0) for work, _ in pace.seen)


@pytest.mark.parametrize("seed", range(5))
def test_the_nonnegative_fit_meets_the_optimality_conditions(seed):
    """x >= 0, and the squared error's gradient is 0 where x > 0 and >= 0 where x = 0 (so no x may move)."""
    rng = np.random.default_rng(seed)
    base = rng.random((64, 1))
    a = np.hstack([base, base * 1.01 + 0.01 * rng.random((64, 1)), rng.random((64, 3))])  # two near-collinear
    b = a @ np.array([1.0, -0.5, 0.3, 0.0, 2.0]) + 0.01 * rng.standard_normal(64)
    x = pace_module.nonnegative_lstsq(a, b)
    gradient = a.T @ (a @ x - b)
    assert (x >= 0).all() and (x == 0).any()  # the unconstrained fit would take a negative here
    assert np.allclose(gradient[x > 0], 0, atol=1e-8) and (gradient[x == 0] >= -1e-8).all()
