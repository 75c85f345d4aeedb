"""Images as dialects receive them: a chat content part's URL -> the image file's bytes.

`data:` URIs (base64) are always read. An http(s) URL makes the server fetch what a client names, so
it is fetched only where the model's option.image_fetch allows it, with image_fetch.py's
guards (no private addresses under `public`, a size and a time limit); else a 400 says so. Every refusal names
the part (`messages[0].content[1]`), as OpenAI's errors do. Decoding the bytes into pixels is the
model's side (serving/vision.py), which names the part the same way.
"""

from __future__ import annotations

import base64
import binascii

from lmi_serve.errors import InvalidRequest
from lmi_serve.dialects.common.image_fetch import MAX_IMAGE_BYTES, FetchPolicy, fetch_image

OFF = FetchPolicy()


def image_bytes(url: str, where: str, fetch: FetchPolicy | None = OFF) -> bytes:
    """The bytes of the image `url` names: a base64 `data:` URI, or an http(s) URL where `fetch` allows
    it; InvalidRequest naming `where` otherwise."""
    if url.startswith(("http://", "https://")):
        return fetch_image(url, where, fetch or OFF)
    if not url.startswith("data:"):
        raise InvalidRequest(f"{where}: an image URL must be a data URI (data:image/png;base64,...)", param=where)
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data URI needs a base64 payload (data:image/png;base64,...)", param=where)
    media = header[:-len(";base64")]
    if media and not media.startswith("image/"):
        raise InvalidRequest(f"{where}: the data URI's media type is {media!r}, not an image", param=where)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:  # before decoding: base64 is 4 characters per 3 bytes
        raise InvalidRequest(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param=where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data URI's payload is not valid base64", param=where) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param=where)
    return data


def check_count(places: list[str], limit: int) -> None:
    """More images than `limit` (option.limit_mm_per_prompt) is a 400 naming the first one over it;
    `places` says where each image is in the request."""
    if len(places) > limit:
        where = places[limit]
        raise InvalidRequest(f"{where}: {len(places)} images in this request, over this model's limit of {limit} "
                             "(option.limit_mm_per_prompt)", param=where)
