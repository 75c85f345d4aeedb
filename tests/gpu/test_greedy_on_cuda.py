"""The rolling engine on CUDA in fp32 answers what transformers answers on the CPU in fp32, token for
token (up to a near-tie in the reference: device_models.compare_greedy), with several rows in the
batch at once, rows joining while others run (their prompts in the running rows' forward: mixed steps)
and leaving when done; for both KV layouts."""

from __future__ import annotations

import pytest

from device_models import compare_greedy, greedy_reference
from engine_prompts import PROMPTS
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

NEW_TOKENS = [12, 3, 9, 16, 6, 1, 10, 4, 14, 7]  # rows finish (leave) at different steps
WAIT_S = 120


def greedy(prompt, n) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def run_staggered(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """Submit every request, waiting for every third one's first token before the next joins, so rows
    start and finish while others run; return each request's token ids."""
    streams = []
    for i, request in enumerate(requests):
        stream = iter(engine.submit(request))
        first = [next(stream)] if i % 3 == 2 else []
        streams.append((stream, first))
    return [[e.token_id for e in first + list(stream)] for stream, first in streams]


@pytest.mark.parametrize("kv", ["slots", "dynamic"])
@pytest.mark.parametrize("name", ["smollm2", "random-smollm2"])
def test_greedy_on_cuda_equals_cpu_fp32_through_the_rolling_engine(name, kv, models, tokenizer, cuda):
    on_cpu, on_cuda = models(name)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    pad = tokenizer.pad_token_id
    references = [greedy_reference(on_cpu, p, n, pad) for p, n in zip(prompts, NEW_TOKENS)]
    engine = Engine(on_cuda, tokenizer, cuda, kv_layout=KV_LAYOUTS[kv], max_batch_size=4, max_queue=100,
                    name=f"gpu-{name}-{kv}").start()
    try:
        got = run_staggered(engine, [greedy(p, n) for p, n in zip(prompts, NEW_TOKENS)])
        stats = engine.stats()
    finally:
        engine.stop()
    compared = 0
    for i, (tokens, reference) in enumerate(zip(got, references)):
        equal, count, why = compare_greedy(tokens, reference)
        assert equal, f"{name}/{kv} prompt {i}: {why}"
        compared += count
    assert stats.largest_batch > 1, "the rows never shared a step"
    # Joiners' prompts rode in the running rows' decode forward (kv/mixed.py) on CUDA too.
    assert stats.mixed_steps > 0, "no step was mixed: the joiners' prompts never shared the decode forward"
    # Near-ties stop a row's comparison early; most tokens must still have been compared.
    assert compared >= sum(NEW_TOKENS) // 2, f"only {compared} of {sum(NEW_TOKENS)} tokens compared (near-ties)"
