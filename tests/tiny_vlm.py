"""Tiny random vision-language models built offline: an Idefics3 (SmolVLM's family) and a LLaVA, each
from its transformers config classes, with a real processor (its image processor at defaults scaled
down to 32-pixel tiles, and SmolLM2's tokenizer with the image tokens added) and a ChatML template
whose image parts become the processor's `<image>` placeholder.

`vlm_folder(family, folder)` saves model and processor with save_pretrained, as a checkpoint is
shipped; `build(family, tokenizer)` gives the model and processor in memory. Weights are redrawn
N(0, 0.3) so the tiny models' greedy output depends on the image (the tests check that premise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TILE = 32  # pixels: the vision encoder's image size
PATCH = 8
FAMILIES = ("idefics3", "llava")
STD = 0.3

# ChatML, as SmolLM2's, with content parts: an image part becomes `<image>` (the processor expands it)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _text(vocab: int, tokenizer) -> dict:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def _vision(**extra) -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=TILE, patch_size=PATCH, **extra)


def _tokenizer(base, extra: list[str]):
    tokenizer = base.__class__.from_pretrained(base.name_or_path) if base.name_or_path else base
    tokenizer.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _idefics3(base) -> tuple[Any, Any]:
    import transformers as tf

    tokenizer = _tokenizer(base, ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    image_processor = tf.Idefics3ImageProcessor(size={"longest_edge": 2 * TILE},
                                                max_image_size={"longest_edge": TILE})
    seq_len = (TILE // PATCH) ** 2 // 4  # scale_factor 2: 4 patches per image token
    processor = tf.Idefics3Processor(image_processor, tokenizer, image_seq_len=seq_len, chat_template=CHAT_TEMPLATE)
    config = tf.Idefics3Config(vision_config=_vision(), text_config=dict(model_type="llama", **_text(len(tokenizer), tokenizer)),
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2)
    return tf.Idefics3ForConditionalGeneration(config), processor


def _llava(base) -> tuple[Any, Any]:
    import transformers as tf

    tokenizer = _tokenizer(base, ["<image>"])
    image_processor = tf.CLIPImageProcessor(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE})
    processor = tf.LlavaProcessor(image_processor, tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                                  num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    config = tf.LlavaConfig(vision_config=dict(model_type="clip_vision_model", **_vision(projection_dim=32)),
                            text_config=dict(model_type="llama", **_text(len(tokenizer), tokenizer)),
                            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                            vision_feature_select_strategy="default", vision_feature_layer=-2)
    return tf.LlavaForConditionalGeneration(config), processor


def build(family: str, tokenizer, seed: int = 0) -> tuple[Any, Any]:
    """(model in eval mode, fp32, weights N(0, STD); processor) of `family`, with SmolLM2's `tokenizer`."""
    torch.manual_seed(seed)
    model, processor = {"idefics3": _idefics3, "llava": _llava}[family](tokenizer)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, STD)
    return model.float().eval(), processor


def vlm_folder(family: str, folder: Path, tokenizer, seed: int = 0) -> Path:
    """A checkpoint folder of `family` (config, safetensors, processor and tokenizer files)."""
    model, processor = build(family, tokenizer, seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def image(seed: int, size: tuple[int, int] = (40, 28)):
    """A random RGB PIL image (width, height): different seeds, different pixels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")
