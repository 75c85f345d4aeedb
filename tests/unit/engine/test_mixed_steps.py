"""One forward per step (engine/kv/mixed.py, prefill.py `_mixed_step`): joiners' prompts and a long
prompt's chunks packed with the running rows' decode.

The KV contract's item 11 (kv/protocol.py) for every decoder-only layout: `decode_with` gives the
logits that `decode()` and `prefill_more` give separately, leaves every batch as those calls would
(the next steps agree too), and leaves every batch as it was when its forward raises. The scheduler
runs a step with joiners as one forward and the outputs stay those of each request alone; a prompt
that makes the mixed forward raise fails alone, and the running rows go on."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.mixed import mixes
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.kv.slot_attention import use_parts
from lmi_serve.engine.kv.slots import SlotKV, SlotLayout
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams

from engine_prompts import PROMPTS  # noqa: E402
from waiting import within  # noqa: E402

CPU = torch.device("cpu")


class EveryLengthItsPart(SlotKV):
    merge_slack = 0  # rows of different lengths stay in parts of their own: the decode side attends per part


LAYOUTS = {**{name: layout for name, layout in KV_LAYOUTS.items() if name in ("dynamic", "slots")},
           "slots-parts": SlotLayout(EveryLengthItsPart)}


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [tuple(smollm2_tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]


def running_batch(model, layout, prompts):
    """A batch of `prompts` (left-padded: their lengths differ) past its first decode step."""
    out = layout.prefill(model, prompts, pad_id=0, device=CPU)
    kv = out.kv
    kv.feed(out.logits.argmax(-1))
    kv.feed(kv.decode().argmax(-1))
    return kv


def copies(model, kv):
    memo = {id(model): model, id(model.config): model.config}
    return copy.deepcopy(kv, memo)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_decode_with_gives_what_decode_and_prefill_more_give(name, tiny_model, prompt_ids):
    layout = LAYOUTS[name]
    layout.prepare(tiny_model)
    assert layout.mixes(tiny_model)
    running = running_batch(tiny_model, layout, prompt_ids[:3])
    started = layout.prefill(tiny_model, [prompt_ids[3][:5]], pad_id=0, device=CPU).kv  # 5 tokens cached
    mixed_rows, mixed_started = (copies(tiny_model, kv) for kv in (running, started))
    mixed_fresh = layout.empty(tiny_model, CPU)
    rest, fresh = prompt_ids[3][5:], prompt_ids[4]

    rows_logits, last = mixed_rows.decode_with([(mixed_started, rest), (mixed_fresh, fresh)])
    expected_rows = running.decode()
    expected_started = started.prefill_more(rest)
    expected_fresh = layout.prefill(tiny_model, [fresh], pad_id=0, device=CPU)
    torch.testing.assert_close(rows_logits, expected_rows, rtol=0, atol=1e-5)
    torch.testing.assert_close(last, torch.cat([expected_started, expected_fresh.logits]), rtol=0, atol=1e-5)
    assert len(mixed_rows) == 3 and len(mixed_started) == len(mixed_fresh) == 1

    # Afterwards each batch is where the separate calls left theirs: the next steps agree.
    pairs = [(mixed_rows, running), (mixed_started, started), (mixed_fresh, expected_fresh.kv)]
    for token in (7, 8, 9):
        for mixed, separate in pairs:
            mixed.feed(torch.full((len(mixed),), token))
            separate.feed(torch.full((len(separate),), token))
            torch.testing.assert_close(mixed.decode(), separate.decode(), rtol=0, atol=1e-5)
    running.extend(started)  # the continued rows join a batch as any prefilled row does
    mixed_rows.extend(mixed_started)
    for kv in (running, mixed_rows):
        kv.feed(torch.full((len(kv),), 11))
    torch.testing.assert_close(mixed_rows.decode(), running.decode(), rtol=0, atol=1e-5)


class RaisesInSecondLayer:
    """A forward hook that raises in the model's second decoder layer once the first has written its
    K/V: a forward failing part-way."""

    def __init__(self, model):
        self.armed = True
        self.handle = model.model.layers[1].register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.armed:
            raise RuntimeError("poisoned layer")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_decode_with_that_raises_leaves_every_batch_as_it_was(name, tiny_model, prompt_ids):
    layout = LAYOUTS[name]
    layout.prepare(tiny_model)
    running = running_batch(tiny_model, layout, prompt_ids[:3])
    started = layout.prefill(tiny_model, [prompt_ids[3][:5]], pad_id=0, device=CPU).kv
    untouched = [copies(tiny_model, kv) for kv in (running, started)]
    fresh = layout.empty(tiny_model, CPU)
    hook = RaisesInSecondLayer(tiny_model)
    try:
        with pytest.raises(RuntimeError, match="poisoned layer"):
            running.decode_with([(started, prompt_ids[3][5:]), (fresh, prompt_ids[4])])
    finally:
        hook.handle.remove()
    for kv, before in zip((running, started), untouched):
        assert kv.lengths == before.lengths
        kv.feed(torch.full((len(kv),), 5))
        before.feed(torch.full((len(before),), 5))
        torch.testing.assert_close(kv.decode(), before.decode(), rtol=0, atol=0)
    fresh.feed(torch.zeros(1, dtype=torch.long))  # the empty row is empty again: its prompt can start over
    assert fresh.lengths == [0]
    torch.testing.assert_close(fresh.prefill_more(prompt_ids[4]),
                               layout.prefill(tiny_model, [prompt_ids[4]], pad_id=0, device=CPU).logits,
                               rtol=0, atol=1e-5)


def _llama(**extra):
    return tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, **extra)


def test_which_models_mix(tiny_model):
    use_parts(tiny_model)
    assert mixes(tiny_model)
    windowed = tf.MistralForCausalLM(tf.MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1, sliding_window=8))
    alibi = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    eager = tf.LlamaForCausalLM(_llama())
    eager.config._attn_implementation = "eager"
    for model in (windowed, alibi):
        use_parts(model)
        assert not mixes(model), model.config.model_type  # its mask carries the window, or the ALiBi bias
    assert not use_parts(eager) and not mixes(eager)  # not attending through kv/slot_attention.py
    seq2seq = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1,
                                                         num_heads=2, d_kv=8))
    assert not mixes(seq2seq)


# -- the scheduler -------------------------------------------------------------------------------

def greedy(prompt, n) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True))


def alone(model, tokenizer, request) -> list[int]:
    return [event.token_id for _, event in generate_static_batch(model, tokenizer, CPU, [request])]


class Forwards:
    """Counts the model's forwards and the tokens each fed; raises for a prompt holding `poison`."""

    def __init__(self, model, poison: int | None = None):
        self.fed: list[int] = []
        self.poison = poison
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        self.fed.append(ids.numel())
        if self.poison is not None and ids.numel() > ids.shape[0] and bool((ids == self.poison).any()):
            raise RuntimeError("poisoned prompt")


def step_until_idle(scheduler, steps: int = 200) -> None:
    for _ in range(steps):
        if scheduler.idle:
            return
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


def test_joiners_ride_in_the_running_rows_forward_and_each_output_is_its_own(tiny_model, smollm2_tokenizer,
                                                                            prompt_ids):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, max_prefill_tokens=16)
    scheduler = engine.scheduler
    requests = [greedy(p, n) for p, n in zip(prompt_ids, (9, 6, 8, 5, 7, 4))]
    long_prompt = tuple(t for p in prompt_ids for t in p)[:40]  # over the 16-token budget: chunked
    requests.append(greedy(long_prompt, 5))
    assert len(long_prompt) > 16
    expected = [alone(tiny_model, smollm2_tokenizer, r) for r in requests]
    forwards = Forwards(tiny_model)
    try:
        first = engine.generate([requests[0]])
        scheduler.step()  # the first request alone: a prefill forward, then a decode forward
        assert len(forwards.fed) == 2
        later = engine.generate(requests[1:])
        before = len(forwards.fed)
        scheduler.step()  # joiners within the budget: one forward with the running row
        assert len(forwards.fed) == before + 1 and scheduler.stats.mixed_steps == 1
        step_until_idle(scheduler)
    finally:
        forwards.handle.remove()
    results = [*within(first.results), *within(later.results)]
    assert [[e.token_id for e in r.events] for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    # Every step with a running batch was one forward: the prompts and chunks never had their own.
    assert scheduler.stats.mixed_steps >= 4  # the long prompt alone takes three chunks
    assert scheduler.stats.admitted == len(requests)


def test_a_prompt_that_makes_the_mixed_forward_raise_fails_alone(tiny_model, smollm2_tokenizer, prompt_ids, caplog):
    poison = smollm2_tokenizer.encode(" zebra", add_special_tokens=False)[0]
    assert all(poison not in p for p in prompt_ids)
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8)
    scheduler = engine.scheduler
    running = [greedy(prompt_ids[0], 8), greedy(prompt_ids[1], 8)]
    good, poisoned = greedy(prompt_ids[2], 5), greedy((*prompt_ids[3], poison), 5)
    expected = [alone(tiny_model, smollm2_tokenizer, r) for r in (*running, good)]
    forwards = Forwards(tiny_model, poison)
    try:
        first = engine.generate(running)
        scheduler.step()
        joiners = [engine.submit(good), engine.submit(poisoned)]
        with caplog.at_level("WARNING", logger="lmi_serve.engine.scheduler"):
            scheduler.step()  # the mixed forward raises; its parts run separately, the poisoned one fails
        assert "A mixed step failed (poisoned prompt)" in caplog.text
        step_until_idle(scheduler)
    finally:
        forwards.handle.remove()
    ran = within(first.results)
    good_result, bad_result = (within(handle.result) for handle in joiners)
    assert [[e.token_id for e in r.events] for r in (*ran, good_result)] == expected
    assert bad_result.finish_reason is FinishReason.ERROR and "poisoned prompt" in bad_result.error
    assert engine.scheduler.stats.admitted == 3


def test_mixed_steps_off_gives_each_prompt_its_own_forward(tiny_model, smollm2_tokenizer, prompt_ids):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, mixed_steps=False)
    scheduler = engine.scheduler
    assert not scheduler.mixed
    forwards = Forwards(tiny_model)
    try:
        engine.generate([greedy(prompt_ids[0], 6)])
        scheduler.step()
        engine.generate([greedy(prompt_ids[1], 3)])
        before = len(forwards.fed)
        scheduler.step()
        assert len(forwards.fed) == before + 2  # the joiner's prefill, then the decode
        step_until_idle(scheduler)
    finally:
        forwards.handle.remove()
    assert scheduler.stats.mixed_steps == 0


def test_a_joiner_with_a_cached_prefix_rides_from_its_blocks(tiny_model, smollm2_tokenizer, prompt_ids):
    """A mixed step starts a joiner from the prefix cache's blocks (kv/prefix_cache.py) and packs only the
    rest of its prompt; the output is the request's alone."""
    from lmi_serve.engine.kv.prefix_cache import PrefixCache

    shared = tuple(t for p in prompt_ids for t in p)[:24]
    first, second = greedy((*shared, *prompt_ids[1]), 6), greedy((*shared, *prompt_ids[2]), 6)
    expected = [alone(tiny_model, smollm2_tokenizer, r) for r in (first, second)]
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, prefix_cache=PrefixCache(2**24, 8))
    scheduler = engine.scheduler
    forwards = Forwards(tiny_model)
    try:
        running = engine.generate([first])
        scheduler.step()  # the first prompt alone (its blocks stored), then its decode
        joiner = engine.generate([second])
        before = len(forwards.fed)
        scheduler.step()
        assert len(forwards.fed) == before + 1 and scheduler.stats.mixed_steps == 1
        # the one forward fed the running row's token and the part of the prompt no block holds
        assert forwards.fed[-1] == 1 + len(second.prompt_ids) - 24
        step_until_idle(scheduler)
    finally:
        forwards.handle.remove()
    assert [[e.token_id for e in r.events] for r in (*within(running.results), *within(joiner.results))] == expected
    assert scheduler.prefixes.stats.hit_tokens == 24


def test_rows_of_lora_adapters_ride_each_token_with_its_adapter(tiny_model, smollm2_tokenizer, prompt_ids,
                                                               tmp_path):
    """A packed forward tells the LoRA layers each token's adapter slot (adapters.lora_rows, packed): running
    rows and joiners of different adapters (and none) give the tokens each gives alone."""
    from lmi_serve.engine.adapters import start_adapters

    from lora_adapters import build_adapter  # noqa: E402

    model = copy.deepcopy(tiny_model)
    adapters = start_adapters(model, CPU, max_loras=4, max_rank=64, dtype="auto", folder=None)
    for name in ("alpha", "beta"):
        adapters.register(name, str(build_adapter(tiny_model, tmp_path, name, std=0.3)))

    def request(prompt, adapter, n):
        return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True),
                                 adapter=adapter)

    running = [request(prompt_ids[1], "alpha", 8), request(prompt_ids[2], None, 8)]
    joiners = [request(prompt_ids[3], "beta", 5), request(prompt_ids[4], None, 5), request(prompt_ids[2], "alpha", 5)]
    expected = []
    alone_engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=8, adapters=adapters).start()
    try:
        for r in (*running, *joiners):  # each alone: nothing to pack it with
            [result] = within(lambda r=r: alone_engine.generate([r]).results())
            expected.append([e.token_id for e in result.events])
    finally:
        alone_engine.stop()
    assert expected[1][:5] != expected[4]  # premise: one prompt, with and without alpha, differs
    engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=8, adapters=adapters)
    scheduler = engine.scheduler
    first = engine.generate(running)
    scheduler.step()
    later = [engine.submit(r) for r in joiners]
    scheduler.step()
    assert scheduler.stats.mixed_steps == 1
    step_until_idle(scheduler)
    got = [[e.token_id for e in r.events] for r in (*within(first.results), *(within(h.result) for h in later))]
    assert got == expected
