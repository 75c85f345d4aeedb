"""Chat `image_url` parts -> the prompt's token ids and images, for a vision-language model.

The rules, in order: a model without images (no processor) refuses any image part, as before; more
parts than option.limit_mm_per_prompt is a 400; `detail` other than `auto` is a 400 (the model's processor
fixes the resolution, so `low` or `high` could not be honoured); each URL is a data URI, or http(s) where
option.image_fetch allows it (dialects/common/images.py); the bytes must decode to an image
(serving/vision.py). Every 400 names the part (`messages[0].content[1]`). The images' tensors then ride
on every sequence of the request.
"""

from __future__ import annotations

from lmi_serve.dialects.common.images import check_count, image_bytes
from lmi_serve.dialects.openai.schema import ChatCompletionRequest
from lmi_serve.engine.types import ImageInputs
from lmi_serve.errors import InvalidRequest


def image_parts(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(URL, where) of every image_url part, in the conversation's order."""
    return [(url, f"messages[{m}].content[{p}]") for m, message in enumerate(request.messages)
            for p, url in message.image_urls]


def refuse_images(found: list[tuple[str, str]]) -> None:
    """A model that takes text only: the first image part is a 400 naming it."""
    if found:
        where = found[0][1]
        raise InvalidRequest(f"{where}: content parts of type 'image_url' are not supported; this model takes "
                             "text parts only", param=where)


def refuse_detail(request: ChatCompletionRequest) -> None:
    """`detail: low|high` asks OpenAI's models for another resolution; this model's processor has one."""
    for m, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            detail = part.get("image_url", {}).get("detail") if part.get("type") == "image_url" else None
            if detail not in (None, "auto"):
                where = f"messages[{m}].content[{p}].image_url.detail"
                raise InvalidRequest(f"{where}: {detail!r} cannot be honoured: this model's processor sets the "
                                     "image's resolution; leave detail out or send 'auto'", param=where)


def prompt_with_images(vision, prompt_text: str, request: ChatCompletionRequest
                       ) -> tuple[list[int], ImageInputs | None]:
    """The token ids of `prompt_text` (rendered with `vision`'s template) with each image placeholder
    expanded, and the images' tensors (None without images)."""
    found = image_parts(request)
    check_count([where for _, where in found], vision.max_images)
    refuse_detail(request)
    images = [(image_bytes(url, where, vision.fetch), where) for url, where in found]
    if images and getattr(request, "truncate_prompt_tokens", None) is not None:
        raise InvalidRequest("truncate_prompt_tokens would cut the images' tokens out of the prompt; "
                             "leave it out with images", param="truncate_prompt_tokens")
    ids, inputs = vision.prepare(prompt_text, images, add_special_tokens=request.add_special_tokens)
    return list(ids), inputs
