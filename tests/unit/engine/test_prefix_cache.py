"""Automatic prefix caching (engine/kv/prefix_cache.py): blocks keyed by their whole prefix, reference
counts, LRU eviction within the memory budget, and in the engine: a prompt whose prefix is cached
generates what it does without the cache, alone, in company, chunked, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from lmi_serve.engine.batch import make_row
from lmi_serve.engine.chunked import ChunkedPrefill
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.encdec import ENCODER_DECODER
from lmi_serve.engine.kv.prefix_cache import PrefixCache
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
from waiting import within

from engine_prompts import PROMPTS

CPU = torch.device("cpu")
BLOCK = 4
LAYERS = 2


def fake_kv(prompt):
    """`kv_of` for a prompt whose K/V are simply its token ids (two layers, one head, dim 1)."""
    def kv_of(start: int, end: int):
        values = torch.tensor(prompt[start:end], dtype=torch.float32)[None, :, None]
        return [(values, -values) for _ in range(LAYERS)]
    return kv_of


def block_bytes() -> int:
    return LAYERS * 2 * BLOCK * 4  # K and V of every layer, float32


def store(cache: PrefixCache, prompt) -> int:
    return cache.store(prompt, fake_kv(prompt))


# -- the cache itself ------------------------------------------------------------------------------

def test_a_prompt_reuses_its_longest_stored_prefix_leaving_one_token_to_prefill():
    cache = PrefixCache(10 * block_bytes(), block_tokens=BLOCK)
    prompt = list(range(100, 112))  # three full blocks
    assert store(cache, prompt) == 3 and len(cache) == 3
    assert cache.cached_tokens(prompt + [7, 8]) == 12
    assert cache.cached_tokens(prompt) == 8  # the last token must be prefilled for the first logits
    assert cache.cached_tokens(prompt[:9]) == 8
    assert cache.cached_tokens([1] + prompt) == 0
    keys, values = cache.prefix_kv(cache.lookup(prompt + [7]))[0]
    assert keys.shape == (1, 1, 12, 1) and keys.flatten().tolist() == prompt and torch.equal(values, -keys)
    assert store(cache, prompt + [7, 8]) == 0  # nothing new: the same blocks


def test_a_block_matches_only_after_the_same_prefix():
    cache = PrefixCache(10 * block_bytes(), block_tokens=BLOCK)
    store(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.cached_tokens([9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # block 2's tokens, another block 1
    assert cache.cached_tokens([1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4


def test_the_least_recently_used_unreferenced_block_is_evicted_first():
    cache = PrefixCache(3 * block_bytes(), block_tokens=BLOCK)
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2])  # a chain of two: the first is referenced by the second
    store(cache, [3, 3, 3, 3])
    cache.acquire([3, 3, 3, 3, 0])  # a prefill reads [3...]: it is now the most recent, and held
    store(cache, [4, 4, 4, 4])  # over budget: the only unreferenced leaf is [..2]
    assert cache.cached_tokens([1, 1, 1, 1, 2, 2, 2, 2, 0]) == 4
    assert cache.stats.evicted_blocks == 1 and cache.nbytes <= cache.budget_bytes
    store(cache, [5, 5, 5, 5])  # [1...] lost its child, so it can go now; [3...] is still held
    assert cache.cached_tokens([1, 1, 1, 1, 0]) == 0
    assert cache.cached_tokens([3, 3, 3, 3, 0]) == 4 and cache.cached_tokens([5, 5, 5, 5, 0]) == 4
    assert cache.stats.blocks == len(cache) == 3


def test_held_and_parent_blocks_are_never_evicted_and_a_block_that_cannot_fit_is_not_stored():
    cache = PrefixCache(2 * block_bytes(), block_tokens=BLOCK)
    chain = [1, 1, 1, 1, 2, 2, 2, 2]
    store(cache, chain)
    held = cache.acquire(chain + [0])
    assert store(cache, [7, 7, 7, 7]) == 0  # everything is held: the new block is dropped, not stored
    assert cache.cached_tokens(chain + [0]) == 8 and cache.nbytes == 2 * block_bytes()
    cache.release(held)
    assert store(cache, [7, 7, 7, 7]) == 1 and cache.cached_tokens(chain + [0]) == 4
    # Storing a long chain never evicts its own earlier blocks for later ones.
    assert store(cache, [8] * 4 * BLOCK) == 2 and cache.cached_tokens([8] * 4 * BLOCK + [0]) == 2 * BLOCK


def test_a_zero_budget_stores_nothing():
    cache = PrefixCache(0, block_tokens=BLOCK)
    assert store(cache, list(range(20))) == 0 and len(cache) == 0


def test_the_kv_caches_of_decoder_only_models_support_prefixes_and_encoder_decoders_do_not():
    assert all(layout.supports_prefixes for layout in KV_LAYOUTS.values())
    assert not ENCODER_DECODER.supports_prefixes
    engine_kwargs = dict(kv_layout=ENCODER_DECODER, prefix_cache=PrefixCache(2**20))
    with pytest.raises(ValueError, match="cached prefix"):
        from lmi_serve.engine.scheduler import Scheduler
        Scheduler(None, None, CPU, max_batch_size=2, max_queue=2, **engine_kwargs)


# -- in the engine ---------------------------------------------------------------------------------

def greedy(prompt, n: int = 8) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def seeded(prompt, seed: int) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, seed=seed),
                             StopParams(max_new_tokens=8, ignore_eos=True))


@pytest.fixture(scope="module")
def shared_prompts(smollm2_tokenizer):
    """Chat-like prompts: one long system prompt, then each engine prompt (so they share ~40 tokens)."""
    system = ("<|im_start|>system\nYou are a careful assistant. Answer briefly, in plain words, and say so "
              "when you do not know the answer.<|im_end|>\n<|im_start|>user\n")
    return [smollm2_tokenizer(system + p).input_ids for p in PROMPTS]


def run(engine: Engine, requests) -> list[list[int]]:
    results = within(lambda: engine.generate(requests).results())
    for result in results:
        assert result.error is None, result.error
    return [[e.token_id for e in r.events] for r in results]


def engine_for(model, tokenizer, kv: str, *, cache: bool, budget: int = 512) -> Engine:
    return Engine(model, tokenizer, CPU, max_batch_size=8, max_prefill_tokens=budget, kv_layout=KV_LAYOUTS[kv],
                  prefix_cache=PrefixCache(64 * 2**20) if cache else None).start()


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_cache_hits_generate_what_misses_do_alone_and_together(kv, tiny_model, smollm2_tokenizer, shared_prompts):
    baseline = engine_for(tiny_model, smollm2_tokenizer, kv, cache=False)
    cached = engine_for(tiny_model, smollm2_tokenizer, kv, cache=True)
    try:
        expected = [run(baseline, [greedy(p)])[0] for p in shared_prompts]
        alone = [run(cached, [greedy(p)])[0] for p in shared_prompts]  # the first misses, the rest hit
        stats = cached.stats().prefix_cache
        assert stats.lookups == len(shared_prompts) and stats.hits == len(shared_prompts) - 1
        assert stats.hit_tokens >= 32 * stats.hits
        together = run(cached, [greedy(p) for p in shared_prompts])  # all hit, prefilled one by one
        assert cached.stats().prefix_cache.hits == 2 * len(shared_prompts) - 1
        assert alone == expected and together == expected
    finally:
        baseline.stop()
        cached.stop()


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_a_hit_whose_rest_is_over_the_budget_is_chunked_and_still_exact(kv, tiny_model, smollm2_tokenizer,
                                                                        shared_prompts):
    budget = 8
    baseline = engine_for(tiny_model, smollm2_tokenizer, kv, cache=False)
    cached = engine_for(tiny_model, smollm2_tokenizer, kv, cache=True, budget=budget)
    try:
        prompts = [shared_prompts[2], shared_prompts[2] + shared_prompts[4]]  # a second turn: long rest
        expected = [run(baseline, [greedy(p)])[0] for p in prompts]
        got = [run(cached, [greedy(p)])[0] for p in prompts]
        assert got == expected
        stats = cached.stats().prefix_cache
        assert stats.hits == 1 and len(prompts[1]) - stats.hit_tokens > budget
    finally:
        baseline.stop()
        cached.stop()


def test_seeded_sampling_is_reproducible_through_a_hit(tiny_model, smollm2_tokenizer, shared_prompts):
    baseline = engine_for(tiny_model, smollm2_tokenizer, "slots", cache=False)
    cached = engine_for(tiny_model, smollm2_tokenizer, "slots", cache=True)
    try:
        expected = run(baseline, [seeded(shared_prompts[1], 7)])
        assert run(cached, [seeded(shared_prompts[0], 1)])  # fills the cache with the system prompt
        assert run(cached, [seeded(shared_prompts[1], 7)]) == expected
        assert cached.stats().prefix_cache.hits == 1
    finally:
        baseline.stop()
        cached.stop()


def test_a_hit_costs_the_prefill_budget_only_its_uncached_tokens(tiny_model, smollm2_tokenizer, shared_prompts):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=30,
                    prefix_cache=PrefixCache(2**20))
    scheduler = engine.scheduler
    first = engine.generate([greedy(shared_prompts[0], n=2)])
    while scheduler.waiting or scheduler.chunking or scheduler.batch:
        scheduler.step()
    assert first.results()[0].error is None
    # Each rest is a few tokens: all three join in one step, although each prompt is over the budget.
    rest = [len(p) - scheduler.prefixes.cached_tokens(p) for p in shared_prompts[1:4]]
    assert sum(rest) <= 30 < min(len(p) for p in shared_prompts[1:4])
    later = engine.generate([greedy(p, n=4) for p in shared_prompts[1:4]])
    scheduler.step()
    assert scheduler.chunking is None and len(scheduler.batch) == 3 and not scheduler.waiting
    while scheduler.batch:
        scheduler.step()
    assert all(r.error is None for r in later.results())


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_row_kv_and_resume_meet_the_kv_contract(kv, tiny_model, smollm2_tokenizer, shared_prompts):
    """A row's K/V read out of a left-padded batch are those of its prompt prefilled alone, and a row
    resumed from them continues as the whole prompt's prefill does."""
    layout, pad = KV_LAYOUTS[kv], smollm2_tokenizer.pad_token_id
    factory = layout.prefill
    short, long = shared_prompts[0][:20], shared_prompts[1]
    together = factory(tiny_model, [short, long], pad_id=pad, device=CPU).kv
    alone = factory(tiny_model, [short], pad_id=pad, device=CPU).kv
    for mine, theirs in zip(together.row_kv(0, 0, 16), alone.row_kv(0, 0, 16)):
        assert mine[0].shape == (2, 16, 16) and torch.allclose(mine[0], theirs[0], atol=1e-5)
        assert torch.allclose(mine[1], theirs[1], atol=1e-5)
    prefix = [(k[None], v[None]) for k, v in together.row_kv(1, 0, 16)]
    resumed = layout.resume(tiny_model, prefix, device=CPU)
    assert len(resumed) == 1 and int(resumed.next_pos[0]) == 16
    logits = resumed.prefill_more(long[16:])
    whole = factory(tiny_model, [long], pad_id=pad, device=CPU).logits
    assert torch.allclose(logits, whole, atol=1e-4) and int(logits.argmax()) == int(whole.argmax())
    resumed.feed(logits.argmax(dim=-1))
    step = resumed.decode()
    assert step.shape == whole.shape


def test_steps_report_the_prefix_caches_token_totals_to_an_observer(tiny_model, smollm2_tokenizer, shared_prompts):
    from lmi_serve.engine.observer import EngineObserver

    class Steps(EngineObserver):
        def __init__(self):
            self.reports = []

        def step_finished(self, report):
            self.reports.append(report)

    steps = Steps()
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, prefix_cache=PrefixCache(64 * 2**20))
    engine.observe(steps)
    engine.start()
    try:
        for prompt in shared_prompts[:2]:  # the first misses, the second hits the shared system prompt
            run(engine, [greedy(prompt)])
    finally:
        engine.stop()
    stats = engine.stats().prefix_cache
    last = steps.reports[-1]
    assert stats.hits == 1 and stats.hit_tokens > 0
    assert (last.prefix_query_tokens, last.prefix_hit_tokens, last.prefix_cache_bytes) == \
        (stats.prompt_tokens, stats.hit_tokens, stats.bytes)
    assert last.prefix_query_tokens == sum(len(p) for p in shared_prompts[:2])


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_a_chunked_prompt_stores_its_blocks_chunk_by_chunk_and_a_hit_on_them_is_exact(kv, tiny_model,
                                                                                     smollm2_tokenizer, shared_prompts):
    """A long prompt's block copies are spread over its chunks (not all in its last step), each block once."""
    prompt = shared_prompts[2] + shared_prompts[4]
    layout = KV_LAYOUTS[kv]
    model = tiny_model
    layout.prepare(model)
    cache = PrefixCache(64 * 2**20)
    prefill = ChunkedPrefill(make_row(greedy(prompt), smollm2_tokenizer), model, layout,
                             smollm2_tokenizer.pad_token_id, CPU, cache)
    held = []
    with torch.no_grad():
        while prefill.advance(20) is None:
            held.append((prefill.done, cache.stats.blocks))
    assert len(held) >= 3 and all(blocks == done // 16 for done, blocks in held), held  # stored as chunks end
    assert cache.stats.blocks == held[-1][1]  # the last chunk's blocks: the scheduler stores those after it
    baseline = engine_for(tiny_model, smollm2_tokenizer, kv, cache=False)
    cached = engine_for(tiny_model, smollm2_tokenizer, kv, cache=True, budget=20)
    try:
        expected = [run(baseline, [greedy(p)])[0] for p in (prompt, prompt[:-3])]
        assert run(cached, [greedy(prompt)])[0] == expected[0]  # chunked: stored chunk by chunk
        assert run(cached, [greedy(prompt[:-3])])[0] == expected[1]  # a hit on those blocks
        stats = cached.stats().prefix_cache
        assert stats.hits == 1 and stats.hit_tokens == (len(prompt) - 4) // 16 * 16
        assert stats.blocks == len(prompt) // 16  # each block stored once, whether by a chunk or at the end
    finally:
        baseline.stop()
        cached.stop()


@pytest.mark.parametrize("kv", sorted(KV_LAYOUTS))
def test_chunks_that_ride_in_mixed_steps_store_their_blocks_and_stay_exact(kv, tiny_model, smollm2_tokenizer,
                                                                           shared_prompts):
    """A long prompt chunked beside a running row (its chunks in the decode forward, kv/mixed.py) stores its
    blocks as they end too, and both rows generate what they do alone without the cache."""
    prompt = shared_prompts[2] + shared_prompts[4]
    running = greedy(shared_prompts[1], n=40)
    baseline = engine_for(tiny_model, smollm2_tokenizer, kv, cache=False)
    cached = engine_for(tiny_model, smollm2_tokenizer, kv, cache=True, budget=20)
    try:
        expected = [run(baseline, [request])[0] for request in (running, greedy(prompt))]
        assert run(cached, [running, greedy(prompt)]) == expected
        stats = cached.stats()
        assert stats.mixed_steps > 0  # the chunks rode in decode forwards, storing blocks after each
        assert stats.prefix_cache.blocks == len(prompt) // 16  # the running row's blocks are the shared start
    finally:
        baseline.stop()
        cached.stop()
