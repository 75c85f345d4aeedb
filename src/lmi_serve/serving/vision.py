"""A vision-language model's images -> the engine's `ImageInputs`, through the model's own processor.

The processor (loaded beside the model, model/loader.py) resizes and normalises each image into the
tensors its vision tower takes (`pixel_values`, and per family `pixel_attention_mask`, `image_sizes`)
and expands each `<image>` placeholder of the prompt text into the number of image tokens whose
embeddings the image's features replace. Both must come from one call, so the prompt's token ids come
from here too. Decoding runs here, not in a dialect: dialects never hold pixels (dialects/README.md).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmi_serve.engine.types import ImageInputs
from lmi_serve.errors import InvalidRequest

MAX_PIXELS = 64_000_000  # a decoded image over this is refused (a small file can expand to gigabytes)
_TEXT_INPUTS = ("input_ids", "attention_mask")  # the prompt itself, not the forward's extra inputs


@dataclass(frozen=True)
class FetchPolicy:
    """option.image_fetch and option.image_fetch_timeout of one model (dialects/common/image_fetch.py
    obeys it)."""

    mode: str = "off"
    timeout: float = 10.0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass
class VisionInputs:
    """The model's processor, how many images one request may carry (option.limit_mm_per_prompt), and
    whether http(s) image URLs are fetched (option.image_fetch)."""

    processor: Any
    max_images: int
    fetch: FetchPolicy | None = None  # option.image_fetch (dialects/common/image_fetch.py); None: data URIs only

    @property
    def image_token(self) -> str:
        """The placeholder text the processor expands into an image's tokens."""
        return getattr(self.processor, "image_token", None) or "<image>"

    @property
    def chat_template(self) -> str | None:
        """The template that renders image parts as the model's placeholders: the processor's, else
        the tokenizer's."""
        return getattr(self.processor, "chat_template", None) or getattr(self.processor.tokenizer, "chat_template", None)

    def prepare(self, prompt: str, images: Sequence[tuple[bytes, str]], add_special_tokens: bool = True
                ) -> tuple[tuple[int, ...], ImageInputs | None]:
        """The prompt's token ids (each placeholder expanded) and its images' tensors, from `images`
        as (file bytes, where the request put it); InvalidRequest naming the part for a file that is
        not an image, or too large once decoded."""
        if not images:
            ids = self.processor.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
            return tuple(ids), None
        pictures = [_decode(data, where) for data, where in images]
        try:
            out = self.processor(text=[prompt], images=pictures, return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        except ValueError as exc:  # e.g. the placeholders do not match the images
            raise InvalidRequest(f"The images do not fit this model's prompt: {exc}", param="messages") from None
        digest = hashlib.sha256()
        for data, _ in images:
            digest.update(hashlib.sha256(data).digest())
        tensors = tuple((name, value) for name, value in out.items() if name not in _TEXT_INPUTS)
        return tuple(out["input_ids"][0].tolist()), ImageInputs(tensors, digest.hexdigest(), len(images))


def _decode(data: bytes, where: str):
    """An RGB PIL image from a file's bytes; InvalidRequest naming `where` when it is none."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only: the size before any pixels
            width, height = probe.size
        if width * height > MAX_PIXELS:
            raise InvalidRequest(f"{where}: the image is {width}x{height} pixels, over {MAX_PIXELS:,}", param=where)
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{where}: the data is not an image this server can decode ({exc})",
                             param=where) from None
