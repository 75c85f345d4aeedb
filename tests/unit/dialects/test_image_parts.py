"""Chat image parts before any model sees them (dialects/common/images.py): only base64 data URIs of
image media types (http(s) only under option.image_fetch: test_image_fetch.py), within the size limit
and the per-request count, `detail` only `auto`; every refusal names the part."""

from __future__ import annotations

import base64

import pytest

from lmi_serve.dialects.common import images
from lmi_serve.dialects.common.images import check_count, image_bytes
from lmi_serve.errors import InvalidRequest

WHERE = "messages[1].content[2]"


def refused(url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        image_bytes(url, WHERE)
    assert caught.value.param == WHERE and caught.value.message.startswith(WHERE)
    return caught.value


def test_a_base64_data_uri_gives_its_bytes():
    assert image_bytes("data:image/png;base64," + base64.b64encode(b"\x89PNG...").decode(), WHERE) == b"\x89PNG..."
    assert image_bytes("data:;base64,AAAA", WHERE) == b"\0\0\0"  # no media type: the decoder decides


@pytest.mark.parametrize("url, words", [
    ("http://example.com/a.png", "option.image_fetch=off"),
    ("https://example.com/a.png", "option.image_fetch=off"),
    ("file:///etc/passwd", "must be a data URI"),
    ("data:image/png,rawbytes", "base64 payload"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png;base64,not*base64", "not valid base64"),
])
def test_other_urls_are_refused_naming_the_part(url, words):
    assert words in refused(url).message


def test_an_image_over_the_size_limit_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 30)
    assert "the image is over" in refused("data:image/png;base64," + "A" * 100).message
    assert "over" in refused("data:image/png;base64," + base64.b64encode(b"x" * 31).decode()).message


def test_more_images_than_the_limit_names_the_first_one_over():
    check_count(["a", "b"], 2)
    with pytest.raises(InvalidRequest, match=r"^c: 3 images in this request, over this model's limit of 2") as caught:
        check_count(["a", "b", "c"], 2)
    assert caught.value.param == "c"


@pytest.mark.parametrize("detail, refused_", [(None, False), ("auto", False), ("low", True), ("high", True)])
def test_detail_other_than_auto_is_refused_naming_it(detail, refused_):
    from lmi_serve.dialects.openai.images import refuse_detail
    from lmi_serve.dialects.openai.schema import ChatCompletionRequest

    image_url = {"url": "data:image/png;base64,AAAA", **({"detail": detail} if detail else {})}
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": image_url}]}]})
    if not refused_:
        refuse_detail(request)
        return
    with pytest.raises(InvalidRequest) as caught:
        refuse_detail(request)
    assert caught.value.param == "messages[1].content[1].image_url.detail" and repr(detail) in caught.value.message
