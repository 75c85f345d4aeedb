"""Images in the rolling batch: tiny random vision-language models of two families (Idefics3, SmolVLM's;
LLaVA), built offline from their configs with real processors (tests/tiny_vlm.py), must come out of the
engine exactly as transformers' greedy `model.generate()` makes them from the same input ids and pixel
values, on both decoder-only KV layouts:

- a prompt with images alone, and one with two images;
- in one batch with text-only prompts and another image prompt (image rows prefill alone, then decode
  with the others);
- over the step's prefill budget (an image prompt is never chunked: it goes whole);
- with the prefix cache on: the same token ids with other pixels never reuse a cached prefix.

Premise: the tiny models' greedy output depends on the pixels, else equality would prove nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import tiny_vlm
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.kv.prefix_cache import PrefixCache
from lmi_serve.engine.kv.select import KV_LAYOUTS
from lmi_serve.engine.types import FinishReason, GenerationRequest, ImageInputs, StopParams
from lmi_serve.errors import InvalidRequest
from waiting import within

CPU = torch.device("cpu")
NEW_TOKENS = 8
TEXT_KEYS = ("input_ids", "attention_mask")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()  # tiny models on a busy 2-core box: intra-op threads only slow them
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Prompt:
    ids: tuple[int, ...]
    images: ImageInputs | None
    inputs: dict[str, Any]  # the processor's output: what generate() gets
    expected: list[int] = None


def image_prompt(processor, text: str, seeds: list[int]) -> Prompt:
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in seeds), {"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=rendered, images=[tiny_vlm.image(s) for s in seeds], return_tensors="pt")
    tensors = tuple((k, v) for k, v in inputs.items() if k not in TEXT_KEYS)
    digest = hashlib.sha256(repr(seeds).encode()).hexdigest()
    return Prompt(tuple(inputs.input_ids[0].tolist()), ImageInputs(tensors, digest, len(seeds)), dict(inputs))


def text_prompt(processor, text: str) -> Prompt:
    inputs = processor.tokenizer(text, return_tensors="pt")
    return Prompt(tuple(inputs.input_ids[0].tolist()), None, dict(inputs))


def reference(model, prompt: Prompt) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**prompt.inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    return out[0, len(prompt.ids):].tolist()


def greedy(prompt: Prompt) -> GenerationRequest:
    return GenerationRequest(prompt.ids, stop=StopParams(max_new_tokens=NEW_TOKENS, eos_token_ids=frozenset(),
                                                         ignore_eos=True), images=prompt.images)


def token_ids(result) -> list[int]:
    assert result.error is None, result.error
    assert result.finish_reason is FinishReason.LENGTH
    return [event.token_id for event in result.events]


@dataclass
class Served:
    family: str
    model: Any
    processor: Any
    prompts: dict[str, Prompt]
    kv_layout: Any

    def engine(self, **options) -> Engine:
        return Engine(self.model, self.processor.tokenizer, CPU, max_batch_size=8, name=self.family,
                      kv_layout=self.kv_layout, **options)


@pytest.fixture(scope="module", params=list(tiny_vlm.FAMILIES))
def family(request, smollm2_tokenizer):
    model, processor = tiny_vlm.build(request.param, smollm2_tokenizer)
    prompts = {
        "cat": image_prompt(processor, "What is in the picture?", [1]),
        "dog": image_prompt(processor, "What is in the picture?", [2]),  # same text, other pixels
        "two": image_prompt(processor, "Compare them.", [3, 4]),
        "short": text_prompt(processor, "Hello"),
        "long": text_prompt(processor, "Once upon a time, in a land far away, there lived a king who"),
    }
    for prompt in prompts.values():
        prompt.expected = reference(model, prompt)
    return request.param, model, processor, prompts


@pytest.fixture(scope="module", params=["slots", "dynamic"])
def served(request, family) -> Served:
    name, model, processor, prompts = family
    return Served(name, model, processor, prompts, KV_LAYOUTS[request.param])


def run(engine: Engine, prompts: list[Prompt]) -> list[list[int]]:
    engine.start()
    try:
        return [token_ids(r) for r in within(lambda: engine.generate([greedy(p) for p in prompts]).results())]
    finally:
        engine.stop()


def test_premise_the_pixels_change_the_output(family):
    _, _, _, prompts = family
    assert prompts["cat"].ids == prompts["dog"].ids
    assert prompts["cat"].expected != prompts["dog"].expected
    assert len(prompts["two"].ids) > len(prompts["cat"].ids)  # two images: more placeholder tokens


def test_an_image_prompt_alone_equals_generate(served):
    engine = served.engine().start()
    try:
        for key in ("cat", "dog", "two"):
            [result] = within(lambda k=key: engine.generate([greedy(served.prompts[k])]).results())
            assert token_ids(result) == served.prompts[key].expected, f"{served.family}: {key}"
    finally:
        engine.stop()


def test_image_and_text_rows_in_one_batch_equal_generate(served):
    order = ["short", "cat", "long", "two", "dog"]
    engine = served.engine()
    got = run(engine, [served.prompts[k] for k in order])
    assert got == [served.prompts[k].expected for k in order]
    assert engine.scheduler.stats.largest_batch >= 3  # they decoded together


def test_an_image_prompt_over_the_prefill_budget_goes_whole(served):
    prompt = served.prompts["two"]
    engine = served.engine(max_prefill_tokens=8)
    assert len(prompt.ids) > 8
    assert run(engine, [prompt]) == [prompt.expected]
    assert engine.scheduler.stats.prefills == 1  # one forward, not chunks


def test_the_prefix_cache_never_serves_an_image_prompt(served):
    cache = PrefixCache(64 << 20, block_tokens=4)
    engine = served.engine(prefix_cache=cache)
    first = run(served.engine(prefix_cache=cache), [served.prompts["cat"]])
    second = run(engine, [served.prompts["dog"]])  # the same token ids: a token-keyed cache would hit
    assert first == [served.prompts["cat"].expected] and second == [served.prompts["dog"].expected]
    assert cache.stats.hits == 0 and cache.stats.stored_blocks == 0


def test_the_context_is_the_text_models(served):
    """The positions live in the text config (512 here), not the VLM's top-level config."""
    text = served.model.config.get_text_config(decoder=True)
    assert served.engine().max_model_len == text.max_position_embeddings == 512


def test_a_text_model_refuses_images(tiny_model, smollm2_tokenizer, family):
    _, _, _, prompts = family
    engine = Engine(tiny_model, smollm2_tokenizer, CPU)
    with pytest.raises(InvalidRequest, match="text only"):
        engine.generate([greedy(prompts["cat"])])


def test_beam_search_refuses_images(served):
    engine = served.engine()
    with pytest.raises(InvalidRequest, match="Beam search with images"):
        engine.submit_beams(greedy(served.prompts["cat"]), 2)


def test_a_bf16_model_serves_fp32_pixels_as_generate_does(family):
    """The processor makes fp32 pixels for a half-precision model (as on a GPU). kv/protocol.py's
    `forward_inputs` casts them to the model's dtype; these two families also cast inside their
    vision code, so this checks the outcome, not that the cast is needed."""
    import copy

    name, model, processor, prompts = family
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert prompts["cat"].images.named()["pixel_values"].dtype == torch.float32
    engine = Engine(half, processor.tokenizer, CPU, name=f"{name}-bf16")
    assert run(engine, [prompts["cat"]]) == [reference(half, prompts["cat"])]
