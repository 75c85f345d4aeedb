"""Per-row token limits (engine/sampling/token_masks.py and their hooks in Row): allowed token ids, banned
token sequences, min_new_tokens, regex grammars; each row's limits leave its neighbours alone."""

from __future__ import annotations

import re

import pytest
import torch

from lmi_serve.engine.batch import Batch, make_row
from lmi_serve.engine.sampling.grammar import GrammarCompiler
from lmi_serve.engine.sampling.token_masks import banned_now
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import (FinishReason, GenerationRequest, GenerationResult, GuidedDecoding,
                                    SamplingParams, StopParams)

from engine_prompts import PROMPTS as ALL_PROMPTS  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = ALL_PROMPTS[1:4]


def req(prompt, n=10, sampling=SamplingParams(), guided=None, **stop) -> GenerationRequest:
    stop.setdefault("ignore_eos", True)
    return GenerationRequest(tuple(prompt), sampling, StopParams(max_new_tokens=n, **stop), guided=guided)


def run_batch(model, tok, requests, constraints=None) -> list[GenerationResult]:
    """Every request in one batch (static batch: one prefill, then decode to the end)."""
    results = [GenerationResult(len(r.prompt_ids)) for r in requests]
    if constraints is None:
        for index, event in generate_static_batch(model, tok, CPU, requests):
            results[index].events.append(event)
        return results
    rows = [make_row(r, tok, owner=i, constraint=c) for i, (r, c) in enumerate(zip(requests, constraints))]
    batch = Batch.prefill(model, rows, tok.pad_token_id, CPU)
    while True:
        for row, event in batch.emit(batch.sample()):
            results[row.owner].events.append(event)
        batch.evict_finished()
        if not len(batch):
            return results
        batch.decode()


def ids(result: GenerationResult) -> list[int]:
    return [e.token_id for e in result.tokens]


def test_allowed_token_ids_are_the_only_choices(tiny_model, smollm2_tokenizer, prompt_ids):
    free = ids(run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0])])[0])
    allowed = frozenset(range(1000, 1010))
    assert not set(free) <= allowed  # premise: unconstrained, it picks other tokens
    for sampling in (SamplingParams(allowed_token_ids=allowed),
                     SamplingParams(allowed_token_ids=allowed, do_sample=True, seed=5)):
        result = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0], sampling=sampling)])[0]
        assert result.generated_tokens == 10 and set(ids(result)) <= allowed


def test_a_one_token_banned_sequence_never_appears(tiny_model, smollm2_tokenizer, prompt_ids):
    free = ids(run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[1])])[0])
    banned = free[0]
    result = run_batch(tiny_model, smollm2_tokenizer,
                       [req(prompt_ids[1], sampling=SamplingParams(banned_sequences=((banned,),)))])[0]
    assert banned not in ids(result) and result.generated_tokens == 10


def test_a_longer_banned_sequence_bans_its_last_token_only_after_the_rest(tiny_model, smollm2_tokenizer,
                                                                       prompt_ids):
    free = ids(run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[2])])[0])
    sequence = (free[0], free[1])
    result = run_batch(tiny_model, smollm2_tokenizer,
                       [req(prompt_ids[2], sampling=SamplingParams(banned_sequences=(sequence,)))])[0]
    out = ids(result)
    assert out[0] == free[0] and out[1] != free[1]  # the first token alone is allowed
    assert all((a, b) != sequence for a, b in zip(out, out[1:]))


def test_banned_now_looks_only_at_the_generated_tail():
    request = req((1, 2), sampling=SamplingParams(banned_sequences=((5, 6, 7), (9,))))
    assert banned_now(request, []) == {9}
    assert banned_now(request, [5, 6]) == {7, 9}
    assert banned_now(request, [5, 6, 1]) == {9}


def test_min_new_tokens_holds_back_eos_and_stop_token_ids(tiny_model, smollm2_tokenizer, prompt_ids):
    free = ids(run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0])])[0])
    stops = {"eos_token_ids": frozenset({free[1]}), "stop_token_ids": frozenset({free[2]}), "ignore_eos": False}
    early = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0], 30, **stops)])[0]
    assert early.finish_reason is FinishReason.EOS_TOKEN and early.generated_tokens <= 3  # premise
    late = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0], 30, min_new_tokens=6, **stops)])[0]
    assert late.generated_tokens > 6
    assert not set(ids(late)[:6]) & {free[1], free[2]}


def test_min_new_tokens_defers_stop_strings(tiny_model, smollm2_tokenizer, prompt_ids):
    free = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[1], 12)])[0]
    first_text = smollm2_tokenizer.decode([free.tokens[0].token_id])
    assert first_text.strip()  # premise: the first token shows text
    early = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[1], 12, stop_sequences=(first_text,))])[0]
    assert early.finish_reason is FinishReason.STOP_SEQUENCE and early.generated_tokens == 1
    assert early.events[-1].stop_sequence == first_text  # the finishing event names the stop string
    late = run_batch(tiny_model, smollm2_tokenizer,
                     [req(prompt_ids[1], 12, stop_sequences=(first_text,), min_new_tokens=4)])[0]
    assert late.generated_tokens > 4
    assert late.text.startswith(first_text)  # the occurrence inside the first 4 tokens did not stop it


def test_a_soft_ban_never_leaves_a_row_without_a_choice(tiny_model, smollm2_tokenizer, prompt_ids):
    only_eos = SamplingParams(allowed_token_ids=frozenset({7}))
    result = run_batch(tiny_model, smollm2_tokenizer, [req(prompt_ids[0], 10, sampling=only_eos, min_new_tokens=5,
                                                           eos_token_ids=frozenset({7}), ignore_eos=False)])[0]
    assert ids(result) == [7] and result.finish_reason is FinishReason.EOS_TOKEN


def test_regex_grammar_output_matches(tiny_model, smollm2_tokenizer, prompt_ids):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    guided = GuidedDecoding(regex=pattern)
    requests = [req(prompt_ids[1], 40, guided=guided, ignore_eos=False, eos_token_ids=frozenset({2}))]
    result = run_batch(tiny_model, smollm2_tokenizer, requests, [compiler.constraint(guided)])[0]
    assert re.fullmatch(pattern, result.text), result.text
    assert result.finish_reason is FinishReason.EOS_TOKEN


def test_a_limited_row_does_not_change_its_neighbours_greedy_output(tiny_model, smollm2_tokenizer, prompt_ids):
    """Greedy rows next to rows with every kind of limit generate what they generate alone."""
    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    free = [req(prompt_ids[0], 12), req(prompt_ids[2], 12)]
    alone = [ids(run_batch(tiny_model, smollm2_tokenizer, [r])[0]) for r in free]
    guided = GuidedDecoding(regex="[a-z]+( [a-z]+)*")
    limited = [
        req(prompt_ids[1], 12, sampling=SamplingParams(allowed_token_ids=frozenset(range(500, 520)))),
        req(prompt_ids[1], 12, sampling=SamplingParams(banned_sequences=((alone[0][0],), tuple(alone[1][:2])))),
        req(prompt_ids[1], 12, min_new_tokens=8, ignore_eos=False, eos_token_ids=frozenset(alone[0])),
        req(prompt_ids[1], 12, guided=guided),
    ]
    requests = [free[0], *limited, free[1]]
    constraints = [None, None, None, None, compiler.constraint(guided), None]
    results = run_batch(tiny_model, smollm2_tokenizer, requests, constraints)
    assert ids(results[0]) == alone[0] and ids(results[-1]) == alone[1]
    assert set(ids(results[1])) <= set(range(500, 520))  # and the limits did hold where asked


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_shown_only_when_asked(tiny_model, smollm2_tokenizer, prompt_ids, skip):
    from lmi_serve.engine.types import DetokenizeParams

    start = smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    request = GenerationRequest(tuple(prompt_ids[0]), SamplingParams(logit_bias=((start, 100.0),)),
                                StopParams(max_new_tokens=2, ignore_eos=True),
                                detokenize=DetokenizeParams(skip_special_tokens=skip))
    result = run_batch(tiny_model, smollm2_tokenizer, [request])[0]
    assert ids(result) == [start, start]
    assert result.text == ("" if skip else "<|im_start|><|im_start|>")
