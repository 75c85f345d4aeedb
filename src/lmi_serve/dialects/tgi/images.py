"""TGI's images: markdown `![](url)` in `inputs`, for a vision-language model.

TGI reads each markdown image in a VLM's prompt as an image at that place in the text (data URIs or
http(s) URLs); a text model keeps the markdown as text, as TGI does. Here each image becomes the
processor's placeholder, which the processor expands into the image's tokens (serving/vision.py),
with the same rules as chat image parts (dialects/common/images.py): the count limit, data URIs
always, http(s) under option.image_fetch, a 400 naming the image otherwise.
"""

from __future__ import annotations

import re

from lmi_serve.dialects.common.images import check_count, image_bytes
from lmi_serve.engine.types import ImageInputs
from lmi_serve.errors import InvalidRequest

MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def prompt_with_images(vision, inputs: str, truncate: int | None) -> tuple[list[int], ImageInputs | None]:
    """The token ids of `inputs` with each markdown image replaced by the model's image placeholder
    (expanded), and the images' tensors (None without images)."""
    found = [(match.group(1), f"inputs, image {i + 1}") for i, match in enumerate(MARKDOWN_IMAGE.finditer(inputs))]
    check_count([where for _, where in found], vision.max_images)
    if found and truncate:
        raise InvalidRequest("parameters.truncate would cut the images' tokens out of the prompt; leave it out "
                             "with images", param="parameters.truncate")
    images = [(image_bytes(url, where, vision.fetch), where) for url, where in found]
    text = MARKDOWN_IMAGE.sub(lambda _: vision.image_token, inputs)
    ids, pictures = vision.prepare(text, images)
    return list(ids), pictures
