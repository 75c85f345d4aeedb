"""Watermarked rows (engine/sampling/watermark.py): transformers' WatermarkDetector finds the mark in a long
watermarked output and not in an unmarked one; the mark is per row and reproducible."""

from __future__ import annotations

import pytest
import torch
from transformers import WatermarkDetector

from lmi_serve.engine.engine import Engine
from lmi_serve.engine.sampling.watermark import Watermark, WatermarkSettings
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams

CPU = torch.device("cpu")
LONG = 200


@pytest.fixture(scope="module")
def engine(tiny_model, smollm2_tokenizer):
    engine = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=8, name="watermark",
                    watermark=Watermark(tiny_model.config.vocab_size, CPU)).start()
    yield engine
    engine.stop()


def request(tokenizer, *, watermark: bool, seed: int | None = 5, tokens: int = LONG, prompt="Once upon a time"):
    ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    sampling = SamplingParams(do_sample=seed is not None, seed=seed, watermark=watermark)
    return GenerationRequest(ids, sampling, StopParams(max_new_tokens=tokens, ignore_eos=True))


def token_ids(engine, req) -> list[int]:
    return [e.token_id for e in engine.submit(req).result().tokens]


def detect(model, ids: list[int], settings=WatermarkSettings()):
    detector = WatermarkDetector(model.config, "cpu", settings.detector_config(), ignore_repeated_ngrams=True)
    return detector(torch.tensor([ids]), return_dict=True)


def test_the_detector_finds_the_mark_in_a_long_watermarked_output_only(engine, tiny_model, smollm2_tokenizer):
    marked = token_ids(engine, request(smollm2_tokenizer, watermark=True))
    plain = token_ids(engine, request(smollm2_tokenizer, watermark=False))
    assert len(marked) == len(plain) == LONG
    found, missed = detect(tiny_model, marked), detect(tiny_model, plain)
    assert found.prediction[0] and found.z_score[0] > 6, found
    assert not missed.prediction[0] and missed.z_score[0] < 3, missed
    # other keys or ratios do not find it: the detector reads this engine's settings
    assert not detect(tiny_model, marked, WatermarkSettings(hashing_key=7)).prediction[0]


def test_the_mark_is_reproducible_and_per_row(engine, smollm2_tokenizer):
    marked = request(smollm2_tokenizer, watermark=True, tokens=30)
    greedy_marked = request(smollm2_tokenizer, watermark=True, seed=None, tokens=30, prompt="The weather today")
    greedy_plain = request(smollm2_tokenizer, watermark=False, seed=None, tokens=30, prompt="The weather today")
    alone = [token_ids(engine, r) for r in (marked, greedy_marked, greedy_plain)]
    assert alone[1] != alone[2]  # the bias changes the greedy choice
    handles = [engine.submit(r) for r in (marked, greedy_marked, greedy_plain,
                                          request(smollm2_tokenizer, watermark=False, seed=9, tokens=30))]
    together = [[e.token_id for e in h.result().tokens] for h in handles[:3]]
    assert together == alone  # each row's mark, and each unmarked row, whatever the batch


def test_a_rows_green_list_depends_on_its_previous_token_only(tiny_model):
    watermark = Watermark(tiny_model.config.vocab_size, CPU)
    first, again, other = (watermark.green_bias([t], tiny_model.config.vocab_size + 3, CPU) for t in (42, 42, 43))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape[-1] == tiny_model.config.vocab_size + 3 and not first[0, -3:].any()
    green = (first[0] == 2.0).sum().item()
    assert green == int(tiny_model.config.vocab_size * 0.5)  # TGI's gamma, transformers' green list size
    assert set(first[0].unique().tolist()) == {0.0, 2.0}  # TGI's delta


def test_an_engine_made_without_a_watermark_refuses_watermarked_requests(tiny_model, smollm2_tokenizer):
    from lmi_serve.errors import InvalidRequest

    bare = Engine(tiny_model, smollm2_tokenizer, CPU, max_batch_size=2, name="bare")
    with pytest.raises(InvalidRequest, match="no watermark"):
        bare.submit(request(smollm2_tokenizer, watermark=True, tokens=2))
