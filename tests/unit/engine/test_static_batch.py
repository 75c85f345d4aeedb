"""generate_static_batch with a tiny random Llama and the real SmolLM2 tokenizer.

The central property: a request's tokens do not depend on what else is in the batch (left
padding, row removal and padding trimming must all be invisible).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lmi_serve.engine.static_batch import eos_token_ids, generate_static_batch
from lmi_serve.engine.types import (
    FinishReason, GenerationRequest, GenerationResult, SamplingParams, StopParams, TokenEvent,
)

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402

CPU = torch.device("cpu")

PROMPTS = ALL_PROMPTS[:6]


def run(model, tok, requests):
    """Collect events per request; also check the event protocol while doing so."""
    events: dict[int, list[TokenEvent]] = defaultdict(list)
    for index, event in generate_static_batch(model, tok, CPU, requests):
        assert 0 <= index < len(requests)
        assert not (events[index] and events[index][-1].finish_reason is not None), \
            f"request {index} got an event after its finishing event"
        events[index].append(event)
    results = []
    for i, request in enumerate(requests):
        evs = events[i]
        assert evs, f"request {i} produced no events"
        assert evs[-1].finish_reason is not None
        assert all(e.finish_reason is None for e in evs[:-1])
        results.append(GenerationResult(len(request.prompt_ids), evs))
    return results


def ids_of(result):
    return [e.token_id for e in result.events]


def greedy(prompt, n=8, **stop):
    return GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=n, **stop))


def test_greedy_is_batch_invariant(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    alone = [run(tiny_model, tok, [greedy(p)])[0] for p in prompt_ids]
    batched = run(tiny_model, tok, [greedy(p) for p in prompt_ids])
    for a, b in zip(alone, batched):
        assert ids_of(a) == ids_of(b)
        assert a.text == b.text
        assert [e.logprob for e in a.events] == pytest.approx([e.logprob for e in b.events], abs=1e-4)
        assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
        assert a.generated_tokens == 8
    # Reversed order in the batch changes nothing either.
    reversed_batch = run(tiny_model, tok, [greedy(p) for p in reversed(prompt_ids)])
    assert [ids_of(r) for r in reversed(reversed_batch)] == [ids_of(a) for a in alone]


def test_greedy_matches_a_plain_forward_loop(tiny_model, smollm2_tokenizer, prompt_ids):
    """The cached, padded path chooses what a cache-free full forward would choose."""
    prompt = list(prompt_ids[2])
    expected = []
    with torch.inference_mode():
        seq = list(prompt)
        for _ in range(5):
            logits = tiny_model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
            expected.append(seq[-1])
    got = run(tiny_model, smollm2_tokenizer, [greedy(prompt_ids[0]), greedy(prompt, 5)])[1]
    assert ids_of(got) == expected


def test_seeded_sampling_is_batch_invariant(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer

    def sampled(prompt, seed):
        return GenerationRequest(tuple(prompt), SamplingParams(do_sample=True, temperature=1.0, seed=seed),
                                 StopParams(max_new_tokens=8, ignore_eos=True))

    alone = [run(tiny_model, tok, [sampled(p, 100 + i)])[0] for i, p in enumerate(prompt_ids[:4])]
    mixed = [sampled(prompt_ids[0], 100), greedy(prompt_ids[4]), sampled(prompt_ids[1], 101),
             GenerationRequest(prompt_ids[5], SamplingParams(do_sample=True, top_k=5)),
             sampled(prompt_ids[2], 102), sampled(prompt_ids[3], 103)]
    batched = run(tiny_model, tok, mixed)
    got = [batched[0], batched[2], batched[4], batched[5]]
    for a, b in zip(alone, got):
        assert ids_of(a) == ids_of(b)
    # A near-uniform random model must actually sample, not fall back to greedy.
    assert ids_of(alone[0]) != ids_of(run(tiny_model, tok, [greedy(prompt_ids[0])])[0])


def test_repetition_penalty_is_batch_invariant(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer

    def penalised(prompt):
        return GenerationRequest(tuple(prompt), SamplingParams(repetition_penalty=1.5),
                                 StopParams(max_new_tokens=10, ignore_eos=True))

    alone = [run(tiny_model, tok, [penalised(p)])[0] for p in prompt_ids]
    batched = run(tiny_model, tok, [penalised(p) if i % 2 else greedy(p, 10, ignore_eos=True)
                                    for i, p in enumerate(prompt_ids)])
    for i in range(1, len(prompt_ids), 2):
        assert ids_of(alone[i]) == ids_of(batched[i])


def test_max_new_tokens_and_early_finishers_do_not_disturb_others(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    # The longest prompt finishes first, so the others' leading padding gets trimmed away.
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    budgets = {index: n for n, index in zip([1, 2, 3, 5, 7, 12], order)}
    reference = {i: ids_of(run(tiny_model, tok, [greedy(p, 12, ignore_eos=True)])[0])
                 for i, p in enumerate(prompt_ids)}
    batched = run(tiny_model, tok, [greedy(p, budgets[i], ignore_eos=True) for i, p in enumerate(prompt_ids)])
    for i, result in enumerate(batched):
        assert result.generated_tokens == budgets[i]
        assert result.finish_reason is FinishReason.LENGTH
        assert ids_of(result) == reference[i][:budgets[i]]


def test_events_are_interleaved_per_step(tiny_model, smollm2_tokenizer, prompt_ids):
    requests = [greedy(prompt_ids[0], 3, ignore_eos=True), greedy(prompt_ids[1], 1, ignore_eos=True),
                greedy(prompt_ids[2], 2, ignore_eos=True)]
    order = [index for index, _ in generate_static_batch(tiny_model, smollm2_tokenizer, CPU, requests)]
    assert order == [0, 1, 2, 0, 2, 0]


def test_eos_ends_a_row_unless_ignored(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    prompt = prompt_ids[1]
    free = ids_of(run(tiny_model, tok, [greedy(prompt, 6)])[0])
    first = free[0]

    stopped = run(tiny_model, tok, [greedy(prompt, 6, eos_token_ids=frozenset({first})),
                                    greedy(prompt_ids[0], 4)])
    assert [e.token_id for e in stopped[0].events] == [first]
    assert stopped[0].finish_reason is FinishReason.EOS_TOKEN
    assert stopped[0].text == ""  # the EOS token itself is not detokenized
    assert stopped[1].finish_reason is FinishReason.LENGTH and stopped[1].generated_tokens == 4

    ignored = run(tiny_model, tok, [greedy(prompt, 6, eos_token_ids=frozenset({first}), ignore_eos=True)])[0]
    assert ids_of(ignored) == free
    assert ignored.finish_reason is FinishReason.LENGTH
    assert ignored.text == tok.decode(free, skip_special_tokens=True)


def test_eos_on_a_later_token_flushes_held_text(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    prompt = prompt_ids[3]
    free = ids_of(run(tiny_model, tok, [greedy(prompt, 6, ignore_eos=True)])[0])
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    # A long stop string that never matches makes the detokenizer hold text back until the EOS flush.
    result = run(tiny_model, tok, [greedy(prompt, 6, eos_token_ids=frozenset({free[k]}),
                                          stop_sequences=("\x00never-matches\x00",))])[0]
    assert ids_of(result) == free[:k + 1]
    assert result.finish_reason is FinishReason.EOS_TOKEN
    assert result.text == tok.decode(free[:k], skip_special_tokens=True)


def test_stop_sequence_cuts_text(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    prompt = prompt_ids[2]
    free = run(tiny_model, tok, [greedy(prompt, 10, ignore_eos=True)])[0]
    full = free.text
    assert len(full) > 6, "test premise: the tiny model produces some text"
    # Stop on the text of the 4th..5th generated token: generation ends when it is complete.
    start = len(tok.decode(ids_of(free)[:3], skip_special_tokens=True))
    stop = full[start:start + 4]
    assert stop and full.find(stop) == start, "test premise: the stop string first occurs there"

    for include, expected in [(False, full[:start]), (True, full[:start + len(stop)])]:
        result = run(tiny_model, tok, [greedy(prompt, 10, ignore_eos=True, stop_sequences=(stop,),
                                              include_stop_str_in_output=include),
                                       greedy(prompt_ids[0], 10, ignore_eos=True)])
        assert result[0].finish_reason is FinishReason.STOP_SEQUENCE
        assert result[0].text == expected
        assert ids_of(result[0]) == ids_of(free)[:result[0].generated_tokens]
        assert result[0].generated_tokens < 10
        assert result[1].finish_reason is FinishReason.LENGTH and result[1].generated_tokens == 10


def test_text_matches_decode_and_special_flag(tiny_model, smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    results = run(tiny_model, tok, [greedy(p, 12, ignore_eos=True) for p in prompt_ids])
    special = set(tok.all_special_ids)
    for r in results:
        assert r.text == tok.decode(ids_of(r), skip_special_tokens=True)
        assert all(e.special == (e.token_id in special) for e in r.events)
        assert all("\ufffd" not in e.text for e in r.events)


def test_single_token_prompt_and_one_new_token(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    result = run(tiny_model, tok, [greedy([tok.bos_token_id], 1, ignore_eos=True)])[0]
    assert result.generated_tokens == 1 and result.finish_reason is FinishReason.LENGTH


def test_eos_token_ids_merges_generation_config_and_tokenizer():
    tok = SimpleNamespace(eos_token_id=2)
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7])), tok) \
        == frozenset({2, 7})
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), tok) \
        == frozenset({2, 5})
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)), tok) \
        == frozenset({2})
    assert eos_token_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=None)) == frozenset()
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=0)),
                         SimpleNamespace(eos_token_id=None)) == frozenset({0})


def test_eos_token_ids_of_real_model(tiny_model, smollm2_tokenizer):
    assert smollm2_tokenizer.eos_token_id in eos_token_ids(tiny_model, smollm2_tokenizer)


class BiasedModel:
    """The tiny model with a fixed bias added to every step's logits, to steer the choice."""

    def __init__(self, model, bias: torch.Tensor):
        self.model, self.bias, self.config = model, bias, model.config

    def __call__(self, **kwargs):
        out = self.model(**kwargs)
        return SimpleNamespace(logits=out.logits + self.bias)


def test_repetition_penalty_sees_prompt_tokens_but_not_padding(tiny_model, smollm2_tokenizer):
    """The pad id is also <|im_end|>: a padded row must penalise it iff its real prompt contains it."""
    tok = smollm2_tokenizer
    pad = tok.pad_token_id
    runner_up = tok.encode(" yes", add_special_tokens=False)[0]
    bias = torch.zeros(len(tok))
    bias[pad], bias[runner_up] = 6.0, 4.0  # pad id wins unless penalised (6 / 10 < 4)
    model = BiasedModel(tiny_model, bias)

    long_plain = tuple(tok.encode("a much longer prompt that forces padding on the others",
                                  add_special_tokens=False))
    short_plain = tuple(tok.encode("short", add_special_tokens=False))
    short_with_pad = tuple(tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False))
    assert pad in short_with_pad and pad not in short_plain and pad not in long_plain
    assert len(short_plain) < len(short_with_pad) < len(long_plain)

    def req(prompt, penalty):
        return GenerationRequest(prompt, SamplingParams(repetition_penalty=penalty), StopParams(max_new_tokens=1))

    results = run(model, tok, [req(long_plain, 10.0), req(short_plain, 10.0), req(short_with_pad, 10.0),
                               req(short_with_pad, 1.0)])
    assert [r.events[0].token_id for r in results] == [pad, pad, runner_up, pad]
    assert results[0].events[0].special and results[0].text == ""
