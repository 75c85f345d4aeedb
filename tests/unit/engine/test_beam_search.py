"""Beam search runs alone on the engine thread and returns every beam through the Row logic."""

from __future__ import annotations

import torch

from lmi_serve.engine.beam_search import beam_search
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.types import FinishReason, GenerationRequest, StopParams


def request(tokenizer, prompt="The capital of France is", max_new_tokens=6, **stop):
    return GenerationRequest(tuple(tokenizer(prompt).input_ids), stop=StopParams(max_new_tokens=max_new_tokens, **stop))


def test_best_beam_matches_transformers_generate(tiny_model, smollm2_tokenizer):
    req = request(smollm2_tokenizer)
    results = beam_search(tiny_model, smollm2_tokenizer, torch.device("cpu"), req, num_beams=3)
    assert len(results) == 3
    prompt = torch.tensor([req.prompt_ids])
    expected = tiny_model.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=3, do_sample=False,
                                   max_new_tokens=6, eos_token_id=None, pad_token_id=smollm2_tokenizer.pad_token_id)
    assert [e.token_id for e in results[0].tokens] == expected[0, prompt.shape[1]:].tolist()
    for result in results:
        assert result.generated_tokens == 6 and result.finish_reason is FinishReason.LENGTH
        assert all(e.finish_reason is None for e in result.events[:-1])
        assert result.text == smollm2_tokenizer.decode([e.token_id for e in result.tokens], skip_special_tokens=True)
    assert len({tuple(e.token_id for e in r.tokens) for r in results}) == 3  # distinct beams


def test_engine_runs_beam_search_between_steps(tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, torch.device("cpu"), max_batch_size=4).start()
    try:
        rolling = engine.submit(request(smollm2_tokenizer, "Once upon a time", max_new_tokens=20))
        beams = engine.beam_search(request(smollm2_tokenizer), num_beams=2)
        assert len(beams) == 2 and all(b.finish_reason is FinishReason.LENGTH for b in beams)
        assert rolling.result().generated_tokens == 20
    finally:
        engine.stop()
