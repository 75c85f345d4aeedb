"""Encoder-decoder rows (kv/encdec.py) beyond greedy equality (which test_architectures.py holds):
the per-row features a causal row has, each compared with transformers' `generate()` where it has
one, on a tiny random T5 (relative positions) and BART (position embeddings, forced `<s>`).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.encdec import decoder_prompt
from lmi_serve.engine.static_batch import generate_static_batch
from lmi_serve.engine.types import FinishReason, GenerationRequest, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest
from waiting import within

CPU = torch.device("cpu")
LENGTHS = (5, 19, 11)


def _t5(vocab: int):
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=vocab, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0,
        pad_token_id=0)), 0.5


def _bart(vocab: int):
    model = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128))
    model.generation_config.forced_bos_token_id = 0
    return model, 0.2


@pytest.fixture(scope="module", params=["t5", "bart"])
def model(request, smollm2_tokenizer):
    torch.manual_seed(0)
    model, std = {"t5": _t5, "bart": _bart}[request.param](len(smollm2_tokenizer))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, std)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    generator = torch.Generator().manual_seed(2)
    first = len(smollm2_tokenizer.all_special_ids) + 1
    return [tuple(torch.randint(first, len(smollm2_tokenizer), (n,), generator=generator).tolist()) for n in LENGTHS]


@pytest.fixture(scope="module")
def engine(model, smollm2_tokenizer):
    engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=8, name="seq2seq").start()
    yield engine
    engine.stop()


def generate(model, prompt, n: int, **options) -> list[int]:
    """transformers' own generation of n new tokens after the decoder prompt the engine uses."""
    start = decoder_prompt(model)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), decoder_input_ids=torch.tensor([start]), max_new_tokens=n,
                             min_new_tokens=n, forced_eos_token_id=None, pad_token_id=0, **options)
    return out[0, len(start):].tolist()


def request(prompt, n: int, sampling: SamplingParams | None = None, **stop) -> GenerationRequest:
    return GenerationRequest(prompt, sampling or SamplingParams(), StopParams(
        max_new_tokens=n, eos_token_ids=frozenset(), ignore_eos=True, **stop))


def ids(result) -> list[int]:
    assert result.error is None, result.error
    return [event.token_id for event in result.events]


def test_the_decoder_prompt_is_the_start_token_then_the_forced_first_token(model):
    forced = model.generation_config.forced_bos_token_id
    start = model.config.decoder_start_token_id
    assert decoder_prompt(model) == ((start,) if forced is None else (start, forced))


def test_repetition_penalty_counts_the_decoder_side_as_generate_does(engine, model, prompts):
    """transformers penalises the decoder's tokens (its prompt and what it generated), never the
    encoder's input. Each prompt ends with the tokens the model generates for it unpenalised, so
    penalising the encoder's input would change the output."""
    penalty = SamplingParams(repetition_penalty=3.0)
    prompts = [p + tuple(generate(model, p, 12, do_sample=False)) for p in prompts]
    expected = [generate(model, p, 12, do_sample=False, repetition_penalty=3.0) for p in prompts]
    assert expected != [generate(model, p, 12, do_sample=False) for p in prompts], "the penalty changed nothing"
    results = within(lambda: engine.generate([request(p, 12, penalty) for p in prompts]).results())
    assert [ids(r) for r in results] == expected


def test_a_stop_sequence_ends_the_row_and_the_others_go_on(engine, model, prompts, smollm2_tokenizer):
    full = within(lambda: engine.generate([request(p, 12) for p in prompts]).results())
    text = full[1].text
    stop = smollm2_tokenizer.decode(ids(full[1])[5:7])
    assert stop and stop in text
    results = within(lambda: engine.generate([request(prompts[0], 12), request(prompts[1], 12, stop_sequences=(stop,)),
                                              request(prompts[2], 12)]).results())
    assert results[1].finish_reason is FinishReason.STOP_SEQUENCE
    assert results[1].text == text[:text.index(stop)]
    assert [ids(r) for r in (results[0], results[2])] == [ids(full[0]), ids(full[2])]


def test_a_cancelled_row_leaves_the_batch_and_the_others_are_unchanged(engine, model, prompts):
    expected = [generate(model, p, 8, do_sample=False) for p in prompts[1:]]
    endless = engine.generate([request(prompts[0], 100_000)])
    within(endless.start)
    others = engine.generate([request(p, 8) for p in prompts[1:]])
    within(others.start)
    endless.close()  # the client went away
    assert [ids(r) for r in within(others.results)] == expected

    def drained() -> None:
        while engine.scheduler.running:
            time.sleep(0.01)
    within(drained)
    assert engine.scheduler.stats.failed_steps == 0


def test_seeded_sampling_repeats_and_does_not_depend_on_the_batch(engine, prompts):
    sampled = SamplingParams(do_sample=True, temperature=1.5, seed=7)
    [alone] = within(lambda: engine.generate([request(prompts[1], 10, sampled)]).results())
    batch = within(lambda: engine.generate([request(prompts[0], 10), request(prompts[1], 10, sampled)]).results())
    assert ids(alone) == ids(batch[1])


def test_prompt_logprobs_are_refused_by_name(engine, prompts):
    with pytest.raises(InvalidRequest, match="encoder-decoder.*decoder_input_details"):
        engine.generate([GenerationRequest(prompts[0], stop=StopParams(max_new_tokens=2), prompt_logprobs=True)])


def test_the_dynamic_batch_path_equals_generate(model, prompts, smollm2_tokenizer):
    got: list[list[int]] = [[] for _ in prompts]
    for index, event in generate_static_batch(model, smollm2_tokenizer, CPU, [request(p, 9) for p in prompts]):
        got[index].append(event.token_id)
    assert got == [generate(model, p, 9, do_sample=False) for p in prompts]


def test_beam_search_equals_generate(model, prompts, smollm2_tokenizer):
    engine = Engine(model, smollm2_tokenizer, CPU, max_batch_size=4).start()  # beams as rows of the batch
    try:
        beams = within(lambda: engine.beam_search(request(prompts[1], 6), 3))
    finally:
        engine.stop()
    start = decoder_prompt(model)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompts[1]]), decoder_input_ids=torch.tensor([start]), num_beams=3,
                             num_return_sequences=3, do_sample=False, max_new_tokens=6, forced_eos_token_id=None,
                             pad_token_id=0)
    assert [ids(b) for b in beams] == [row[len(start):] for row in out.tolist()]
