"""Constrained decoding in the rolling batch: a random-weights model still produces output that
parses and satisfies the schema, per row, beside unconstrained rows; logit biases steer tokens."""

from __future__ import annotations

import json

import pytest
import torch

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.sampling.grammar import GrammarError
from lmi_serve.engine.sampling.sampler import HeterogeneousSampler
from lmi_serve.engine.types import FinishReason, GenerationRequest, GuidedDecoding, SamplingParams, StopParams

CPU = torch.device("cpu")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, name="guided").start()
    yield engine
    engine.stop()


def request(tokenizer, guided=None, *, sample=False, seed=None, max_new_tokens=120, bias=()):
    ids = tuple(tokenizer.encode("Give me the weather as JSON:", add_special_tokens=False))
    return GenerationRequest(ids, SamplingParams(do_sample=sample, seed=seed, logit_bias=bias),
                             StopParams(max_new_tokens=max_new_tokens, eos_token_ids=frozenset({2})), guided=guided)


def validate(value: dict) -> None:
    assert set(value) == {"city", "unit", "days"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert value["unit"] in ("celsius", "fahrenheit")
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


def test_schema_constrained_rows_parse_and_validate_beside_free_rows(engine, smollm2_tokenizer):
    guided = GuidedDecoding(json_schema=json.dumps(SCHEMA))
    handles = [engine.submit(request(smollm2_tokenizer, guided, sample=True, seed=s)) for s in range(4)]
    free = engine.submit(request(smollm2_tokenizer, max_new_tokens=10))
    for handle in handles:
        result = handle.result()
        assert result.finish_reason is FinishReason.EOS_TOKEN, result.text
        validate(json.loads(result.text))
    assert free.result().generated_tokens == 10  # the random model never says EOS: nothing constrained it


def test_any_json_object(engine, smollm2_tokenizer):
    guided = GuidedDecoding(json_schema=json.dumps({"type": "object"}))
    result = engine.submit(request(smollm2_tokenizer, guided, sample=True, seed=7, max_new_tokens=300)).result()
    if result.finish_reason is FinishReason.EOS_TOKEN:
        assert isinstance(json.loads(result.text), dict)
    else:  # a random model may keep an open object going; it must still be a JSON object prefix
        assert result.finish_reason is FinishReason.LENGTH and result.text.startswith("{")


def test_lark_grammar_choice(engine, smollm2_tokenizer):
    guided = GuidedDecoding(lark='start: "yes" | "no"')
    result = engine.submit(request(smollm2_tokenizer, guided)).result()
    assert result.text in ("yes", "no")
    assert result.finish_reason is FinishReason.EOS_TOKEN


def test_invalid_grammar_is_rejected_at_submit(engine, smollm2_tokenizer):
    with pytest.raises(GrammarError):
        engine.submit(request(smollm2_tokenizer, GuidedDecoding(lark="start: undefined_rule")))
    with pytest.raises(GrammarError):
        engine.submit(request(smollm2_tokenizer, GuidedDecoding(json_schema="{not json")))


def test_greedy_output_does_not_depend_on_a_constrained_neighbour(engine, smollm2_tokenizer):
    alone = engine.submit(request(smollm2_tokenizer, max_new_tokens=12)).result()
    guided = GuidedDecoding(json_schema=json.dumps(SCHEMA))
    neighbour = engine.submit(request(smollm2_tokenizer, guided, sample=True, seed=3))
    beside = engine.submit(request(smollm2_tokenizer, max_new_tokens=12)).result()
    neighbour.result()
    assert [e.token_id for e in beside.tokens] == [e.token_id for e in alone.tokens]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.zeros((2, 10))
    logits[:, 3] = 5.0
    params = [SamplingParams(logit_bias=((7, 100.0),)), SamplingParams(logit_bias=((3, -100.0),))]
    sampler = HeterogeneousSampler(params, CPU, 10)
    out = sampler(logits)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] != 3
    # logprobs stay the model's own: the forced token is reported with its unbiased logprob
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[7].item())


def test_allowed_mask_applies_to_greedy_and_sampled_rows():
    logits = torch.zeros((2, 6))
    logits[:, 0] = 10.0
    allowed = torch.tensor([[False, True, False, False, False, False], [False, False, False, False, True, False]])
    sampler = HeterogeneousSampler([SamplingParams(), SamplingParams(do_sample=True, seed=1)], CPU, 6)
    assert sampler(logits, allowed=allowed).token_ids == [1, 4]


def test_a_token_the_grammar_rejects_ends_only_that_row(smollm2_tokenizer):
    from lmi_serve.engine.batch import make_row
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    req = request(smollm2_tokenizer, GuidedDecoding(lark='start: "yes"'))
    row = make_row(req, smollm2_tokenizer, constraint=compiler.constraint(req.guided))
    wrong = smollm2_tokenizer.encode("no", add_special_tokens=False)[0]
    event = row.advance(wrong, -1.0, [])
    assert event.finish_reason is FinishReason.ERROR and "rejected" in event.error and row.finished


def test_generate_queues_all_or_none(engine, smollm2_tokenizer):
    queued = []
    original = engine.submit

    def recording(req, **where):
        handle = original(req, **where)
        queued.append(handle)
        return handle

    engine.submit = recording
    try:
        with pytest.raises(GrammarError):
            engine.generate([request(smollm2_tokenizer, max_new_tokens=50),
                               request(smollm2_tokenizer, GuidedDecoding(lark="start: undefined_rule"))])
    finally:
        del engine.submit
    assert len(queued) == 1 and queued[0].cancelled
