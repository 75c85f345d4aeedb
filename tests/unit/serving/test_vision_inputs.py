"""A vision-language model's images through its processor (serving/vision.py): the prompt's
placeholder expanded into the image tokens, the pixels as the forward's tensors, the digest telling
images apart; files that are no image, or too many pixels once decoded, refused naming the part."""

from __future__ import annotations

import io

import pytest

import tiny_vlm
from lmi_serve.errors import InvalidRequest
from lmi_serve.serving import vision
from lmi_serve.serving.vision import VisionInputs


def png(seed: int, size=(40, 28)) -> bytes:
    buffer = io.BytesIO()
    tiny_vlm.image(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llava(smollm2_tokenizer):
    model, processor = tiny_vlm.build("llava", smollm2_tokenizer)
    return VisionInputs(processor, max_images=4), model.config.image_token_index


def test_the_placeholder_is_expanded_and_the_pixels_ride_along(llava):
    inputs, image_token = llava
    prompt = inputs.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], add_generation_prompt=True)
    ids, images = inputs.prepare(prompt, [(png(1), "p0")])
    assert ids.count(image_token) == (tiny_vlm.TILE // tiny_vlm.PATCH) ** 2  # one token per patch
    assert images.count == 1 and images.named()["pixel_values"].shape == (1, 3, tiny_vlm.TILE, tiny_vlm.TILE)
    _, same = inputs.prepare(prompt, [(png(1), "p0")])
    _, other = inputs.prepare(prompt, [(png(2), "p0")])
    assert same == images and other != images  # by the bytes' digest
    assert inputs.prepare("no image here", []) == (tuple(inputs.processor.tokenizer("no image here").input_ids), None)


def test_files_that_are_no_image_or_too_large_are_refused_naming_the_part(llava, monkeypatch):
    inputs, _ = llava
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.content\[1\]: the data is not an image") as caught:
        inputs.prepare("<image>", [(b"GIF89a but not really", "messages[0].content[1]")])
    assert caught.value.param == "messages[0].content[1]"
    monkeypatch.setattr(vision, "MAX_PIXELS", 40 * 28 - 1)
    with pytest.raises(InvalidRequest, match=r"^p: the image is 40x28 pixels, over 1,119"):
        inputs.prepare("<image>", [(png(1), "p")])
