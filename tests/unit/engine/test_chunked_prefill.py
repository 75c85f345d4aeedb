"""Chunked prefill (engine/chunked.py): a prompt over the step's prefill budget is prefilled a
chunk per step while the running rows keep decoding, and generates what a whole prefill does."""

from __future__ import annotations

import math

import pytest
import torch

from lmi_serve.engine.chunked import attention_crossover, chunk_tokens
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams
from waiting import within

CPU = torch.device("cpu")
BUDGET = 8  # prompt tokens per step: every prompt below is longer


def greedy(prompt, n: int = 6, **extra) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True), **extra)


@pytest.fixture(scope="module")
def long_prompts(smollm2_tokenizer):
    generator = torch.Generator().manual_seed(3)
    first = len(smollm2_tokenizer.all_special_ids) + 1
    return [tuple(torch.randint(first, len(smollm2_tokenizer), (n,), generator=generator).tolist())
            for n in (37, 20, 9, 61)]


def ids(result) -> list[int]:
    assert result.error is None, result.error
    return [e.token_id for e in result.events]


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_chunked_prompts_generate_what_whole_prefills_do(kv, tiny_model, smollm2_tokenizer, long_prompts):
    def run(budget: int) -> list[list[int]]:
        engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=budget,
                        kv_layout=KV_LAYOUTS[kv]).start()
        try:
            return [ids(r) for r in within(lambda: engine.generate([greedy(p) for p in long_prompts]).results())]
        finally:
            engine.stop()
    assert run(BUDGET) == run(4096)


def test_running_rows_get_a_token_every_step_while_a_long_prompt_is_chunked(tiny_model, smollm2_tokenizer,
                                                                          long_prompts):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=BUDGET)
    scheduler = engine.scheduler
    running = engine.generate([greedy(long_prompts[2][:5], n=40)])
    scheduler.step()  # the short prompt joins
    long = engine.generate([greedy(long_prompts[3], n=3)])  # 61 tokens: chunks of at most 8
    crossover, done, sizes = attention_crossover(tiny_model), 0, []
    while done < len(long_prompts[3]):  # the chunks the budget allows, shorter as the context grows
        sizes.append(min(chunk_tokens(BUDGET, done, crossover), len(long_prompts[3]) - done))
        done += sizes[-1]
    assert sizes[0] == BUDGET - 1 and sizes[-2] < sizes[0]  # the tiny model's attention is a large share
    chunks = 0
    while True:
        before = scheduler.stats.prefills
        scheduler.step()
        assert len(scheduler.batch) >= 1
        chunks += 1
        if scheduler.stats.prefills > before:
            break
        assert scheduler.chunking is not None and scheduler.chunking.done == sum(sizes[:chunks])
    assert chunks == len(sizes)
    while scheduler.batch:
        scheduler.step()
    [first], [second] = running.results(), long.results()
    assert len(ids(first)) == 40 and len(ids(second)) == 3
    # The short row's first step gave it two tokens (prefill, then decode), every later step one: 40
    # tokens in 39 steps, the chunks' steps included, so no step passed it by.
    assert scheduler.stats.steps == 40 - 1


@pytest.mark.parametrize("budget, done, crossover, expected", [
    (512, 0, math.inf, 512),  # no crossover known: tokens count alone
    (512, 0, 3072.0, 475),  # SmolLM2's crossover: 475 x (1 + 237.5 / 3072) <= 512
    (512, 1500, 3072.0, 331),  # deep into the prompt, the same budget buys fewer tokens
    (1, 10**6, 3072.0, 1),  # always at least one token
])
def test_chunk_tokens_counts_attention_over_the_context(budget, done, crossover, expected):
    n = chunk_tokens(budget, done, crossover)
    assert n == expected
    if math.isfinite(crossover) and n > 1:
        cost = lambda k: k * (1 + (done + k / 2) / crossover)  # noqa: E731
        assert cost(n) <= budget < cost(n + 1)


def test_attention_crossover_of_smollm2_shape(tiny_model):
    config = tiny_model.config  # hidden 64, 4 heads of 16, 2 KV heads, MLP 128
    linear = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    assert attention_crossover(tiny_model) == linear / (2 * 4 * 16) and config.hidden_size == 64


def test_a_cancelled_chunked_prompt_ends_at_once(tiny_model, smollm2_tokenizer, long_prompts):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=BUDGET)
    scheduler = engine.scheduler
    long = engine.generate([greedy(long_prompts[3])])
    scheduler.step()
    assert scheduler.chunking is not None
    long.close()
    scheduler.step()
    assert scheduler.chunking is None and not scheduler.batch and scheduler.running == 0
    assert scheduler.stats.prefills == 0


def test_prompt_logprobs_and_encoder_decoders_are_prefilled_whole(tiny_model, smollm2_tokenizer, long_prompts):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=BUDGET)
    scheduler = engine.scheduler
    generation = engine.generate([greedy(long_prompts[0], n=2, prompt_logprobs=True)])
    scheduler.step()
    assert scheduler.chunking is None and scheduler.stats.prefills == 1  # the whole prompt at once
    while scheduler.batch:
        scheduler.step()
    [result] = generation.results()
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.events[0].prompt_tokens) == len(long_prompts[0])
    assert KV_LAYOUTS["dynamic"].supports_chunks and KV_LAYOUTS["slots"].supports_chunks
    assert not ENCODER_DECODER.supports_chunks
