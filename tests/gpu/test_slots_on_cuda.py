"""The slot KV cache (engine/kv/slots.py, the default layout) on CUDA: over many steps rows join (a long
prompt among short ones, so the batch holds several parts), leave when done or cancelled, and the freed
rows are taken by new ones; every row's greedy tokens equal that prompt generated alone on the same
device (plain transformers `generate`, up to a near-tie: device_models.compare_greedy)."""

from __future__ import annotations

import pytest

from device_models import compare_greedy, greedy_reference
from engine_prompts import PROMPTS
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.slots import SLOTS
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

# 16 requests through 4 rows: lengths 1..40 tokens, so rows are evicted and replaced at many steps.
NEW_TOKENS = [40, 2, 17, 5, 31, 1, 9, 24, 3, 12, 36, 7, 20, 4, 15, 28]
CANCELLED = 4  # this one is cancelled after its third token: its row leaves early


@pytest.mark.parametrize("name", ["smollm2", "random-smollm2"])
def test_slot_rows_join_leave_and_are_evicted_on_cuda_and_equal_each_row_alone(name, models, tokenizer, cuda):
    _, on_cuda = models(name)
    pad = tokenizer.pad_token_id
    short = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    long = tokenizer.encode(" ".join(PROMPTS) * 3, add_special_tokens=False)[:320]  # wider than MERGE_SLACK
    prompts = [short[i % len(short)] if i != 6 else long for i in range(len(NEW_TOKENS))]
    references = [greedy_reference(on_cuda, p, n, pad) for p, n in zip(prompts, NEW_TOKENS)]
    engine = Engine(on_cuda, tokenizer, cuda, kv_layout=SLOTS, max_batch_size=4, max_queue=100,
                    max_prefill_tokens=128, name=f"gpu-slots-{name}").start()
    try:
        handles, got = [], []
        for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS)):
            handles.append(engine.submit(GenerationRequest(tuple(p), SamplingParams(),
                                                           StopParams(max_new_tokens=n, ignore_eos=True))))
        for i, handle in enumerate(handles):
            tokens = []
            for event in handle:
                tokens.append(event.token_id)
                if i == CANCELLED and len(tokens) == 3:
                    handle.cancel()
                    break
            got.append(tokens)
        stats = engine.stats()
    finally:
        engine.stop()
    for i, (tokens, reference) in enumerate(zip(got, references)):
        if i == CANCELLED:
            reference.tokens, reference.margins = reference.tokens[:3], reference.margins[:3]
        equal, _, why = compare_greedy(tokens, reference)
        assert equal, f"{name} request {i} ({len(prompts[i])} prompt tokens): {why}"
    assert stats.admitted == len(NEW_TOKENS) and stats.largest_batch == 4
    assert stats.failed_steps == 0
