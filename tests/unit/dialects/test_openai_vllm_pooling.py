"""vLLM's pooling fields on /v1/embeddings without a server: `embed_dtype` / `endianness` lay out
base64 vectors as vLLM does, `truncate_prompt_tokens` / `truncation_side` cut inputs as vLLM's
tokenizer does; `dimensions`, `use_activation` / `normalize` and `prompt_name` reach a handler that
takes them, and are refused naming the field by one that does not."""

from __future__ import annotations

import base64
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmi_serve.dialects.openai.routes import _embedding_options, _embedding_prompt, _encode, _truncated
from lmi_serve.dialects.openai.schema import EmbeddingRequest, parse
from lmi_serve.errors import InvalidRequest

VECTOR = [0.1, -0.25, 0.3333333, 1e-3, -0.999]


def request(**fields) -> EmbeddingRequest:
    return parse(EmbeddingRequest, {"input": "x", **fields})


def decoded(text: str, dtype, big: bool) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.dtype(dtype).newbyteorder(">" if big else "<"))


@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_base64_float32_and_float16_in_either_byte_order(endianness):
    big = endianness == "big" or endianness == "native" and sys.byteorder == "big"
    f32 = decoded(_encode(VECTOR, "base64", "float32", endianness), np.float32, big)
    assert f32.tolist() == np.array(VECTOR, dtype=np.float32).tolist()
    f16 = decoded(_encode(VECTOR, "base64", "float16", endianness), np.float16, big)
    assert f16.tolist() == np.array(VECTOR, dtype=np.float16).tolist()


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn),
                                               ("fp8_e5m2", torch.float8_e5m2)])
def test_narrow_types_are_torchs_rounding_of_the_float32_vector(dtype, torch_dtype):
    expected = torch.tensor(VECTOR, dtype=torch.float32).to(torch_dtype)
    for endianness in ("little", "big"):
        raw = base64.b64decode(_encode(VECTOR, "base64", dtype, endianness))
        assert len(raw) == len(VECTOR) * expected.element_size()
        if endianness == "big" and expected.element_size() == 2:
            raw = b"".join(raw[i:i + 2][::-1] for i in range(0, len(raw), 2))
        got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype)
        assert torch.equal(got.float(), expected.float())


def test_a_float_list_is_unchanged_by_the_base64_layout_fields():
    assert _encode(VECTOR, "float", "float16", "big") == VECTOR


def test_the_default_base64_is_what_the_openai_client_reads():
    assert _encode(VECTOR, "base64") == base64.b64encode(np.array(VECTOR, dtype="<f4").tobytes()).decode()


class Handler:
    """A handler whose tokenizer writes [0] + one token per word + [9]."""

    vocabulary_size = staticmethod(lambda: 100)

    @staticmethod
    def truncated_token_ids(texts, keep, side):
        rows = []
        for text in texts:
            words = [int(w) for w in text.split()]
            words = words[:keep - 2] if side == "right" else words[len(words) - (keep - 2):]
            rows.append([0, *words, 9])
        return rows


def test_token_ids_keep_the_last_tokens_or_the_first_with_truncation_side_right():
    inputs, counts = [[1, 2, 3, 4, 5], [6, 7]], [5, 2]
    assert _truncated(request(truncate_prompt_tokens=3), inputs, counts, Handler, 512) == ([[3, 4, 5], [6, 7]], [3, 2])
    assert _truncated(request(truncate_prompt_tokens=3, truncation_side="right"), inputs, counts, Handler, 512) \
        == ([[1, 2, 3], [6, 7]], [3, 2])
    assert _truncated(request(truncate_prompt_tokens=-1), inputs, counts, Handler, 4) \
        == ([[2, 3, 4, 5], [6, 7]], [4, 2])
    assert _truncated(request(), inputs, counts, Handler, 4) == (inputs, counts)


def test_long_texts_are_cut_by_the_handler_keeping_its_special_tokens():
    inputs, counts = ["1 2 3 4 5", "6"], [7, 3]
    cut, new_counts = _truncated(request(truncate_prompt_tokens=4), inputs, counts, Handler, 512)
    assert cut == [[0, 4, 5, 9], "6"] and new_counts == [4, 3]
    cut, _ = _truncated(request(truncate_prompt_tokens=4, truncation_side="right"), inputs, counts, Handler, 512)
    assert cut == [[0, 1, 2, 9], "6"]


NO_CUTTER = SimpleNamespace(truncated_token_ids=None, vocabulary_size=None)


@pytest.mark.parametrize("handler,keep,limit", [(NO_CUTTER, 4, 512), (Handler, 600, 512)])
def test_a_truncation_that_cannot_apply_is_a_400_naming_the_field(handler, keep, limit):
    with pytest.raises(InvalidRequest) as caught:
        _truncated(request(truncate_prompt_tokens=keep), ["1 2 3 4 5"], [7], handler, limit)
    assert caught.value.param == "truncate_prompt_tokens"


# Every field vLLM's EmbeddingCompletionRequest declares (vllm/entrypoints/pooling/base/protocol.py: the
# PoolingBasicRequestMixin, CompletionRequestMixin and EmbedRequestMixin it is made of); `normalize` is
# its older spelling of use_activation.
VLLM_EMBEDDING_FIELDS = ("model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id",
                         "priority", "mm_processor_kwargs", "cache_salt", "input", "add_special_tokens",
                         "encoding_format", "embed_dtype", "endianness", "dimensions", "use_activation")


def test_every_vllm_embedding_field_is_honoured_or_refused_never_ignored():
    """A field vLLM declares is one of the request's own (honoured, or refused by `vllm_refused` past
    its neutral values): none falls through to the unknown fields that are logged and ignored."""
    assert set(VLLM_EMBEDDING_FIELDS) <= set(EmbeddingRequest.model_fields)
    assert set(EmbeddingRequest.vllm_refused) <= set(EmbeddingRequest.model_fields)


@pytest.mark.parametrize("padding", ["max_length", "longest", "MAX_LENGTH", True])
def test_padding_other_than_do_not_pad_is_a_400_naming_it(padding):
    with pytest.raises(InvalidRequest) as caught:
        request(padding=padding)
    assert caught.value.param == "padding" and "`padding`" in str(caught.value)
    for neutral in ("do_not_pad", None):
        assert request(padding=neutral).model_extra == {}


def test_request_id_and_cache_salt_are_taken():
    assert request(request_id="r1", cache_salt="salt").request_id == "r1"
    with pytest.raises(InvalidRequest) as caught:
        request(cache_salt="")
    assert caught.value.param == "cache_salt"


@pytest.mark.parametrize("body,param", [({"add_special_tokens": False}, "add_special_tokens"),
                                        ({"priority": 3}, "priority"),
                                        ({"mm_processor_kwargs": {"size": 2}}, "mm_processor_kwargs"),
                                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                                        ({"truncation_side": "middle"}, "truncation_side"),
                                        ({"embed_dtype": "int8"}, "embed_dtype"),
                                        ({"endianness": "middle"}, "endianness")])
def test_values_that_cannot_be_honoured_are_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequest) as caught:
        request(**body)
    assert caught.value.param == param and param in str(caught.value)


def test_the_neutral_values_are_accepted():
    for body in ({"use_activation": True}, {"use_activation": None}, {"normalize": True}, {"normalize": False},
                 {"add_special_tokens": True}, {"priority": 0}, {"mm_processor_kwargs": {}}):
        assert request(**body).model_extra == {}


PROMPTED = SimpleNamespace(embedding_prompt=lambda name: {None: ("query: ", False), "doc": ("", False)}[name]
                           if name in (None, "doc") else (_ for _ in ()).throw(ValueError(f"{name!r} is unknown")),
                           truncated_token_ids=Handler.truncated_token_ids, vocabulary_size=Handler.vocabulary_size)
PLAIN = SimpleNamespace(embedding_prompt=None, truncated_token_ids=None, vocabulary_size=None)


def test_a_handler_with_prompts_takes_dimensions_and_normalize():
    assert _embedding_options(request(dimensions=8, use_activation=False), PROMPTED, "m", 64) == \
        {"dimensions": 8, "normalize": False}
    assert _embedding_options(request(normalize=True), PROMPTED, "m", 64) == {"normalize": True}
    assert _embedding_options(request(), PROMPTED, "m", 64) == {}


@pytest.mark.parametrize("handler,body,param", [(PROMPTED, {"dimensions": 65}, "dimensions"),
                                                (PLAIN, {"dimensions": 8}, "dimensions"),
                                                (PLAIN, {"use_activation": False}, "use_activation"),
                                                (PLAIN, {"normalize": False}, "normalize")])
def test_options_a_handler_cannot_honour_are_a_400_naming_the_field(handler, body, param):
    with pytest.raises(InvalidRequest) as caught:
        _embedding_options(request(**body), handler, "m", 64)
    assert caught.value.param == param and param in str(caught.value)


def test_the_prompt_is_the_instruction_the_named_one_or_the_default():
    assert _embedding_prompt(request(), PROMPTED, ["x"]) == ("query: ", False)
    assert _embedding_prompt(request(prompt_name="doc"), PROMPTED, ["x"]) == ("", False)
    assert _embedding_prompt(request(instruction="Find:"), PROMPTED, ["x"]) == ("Find: ", False)
    assert _embedding_prompt(request(), PLAIN, ["x"]) == ("", True)


@pytest.mark.parametrize("handler,body,inputs", [(PROMPTED, {"prompt_name": "nope"}, ["x"]),
                                                 (PROMPTED, {"prompt_name": "doc", "instruction": "Find:"}, ["x"]),
                                                 (PROMPTED, {"prompt_name": "doc"}, [[1, 2]]),
                                                 (PLAIN, {"prompt_name": "doc"}, ["x"])])
def test_a_prompt_name_that_cannot_apply_is_a_400_naming_it(handler, body, inputs):
    with pytest.raises(InvalidRequest) as caught:
        _embedding_prompt(request(**body), handler, inputs)
    assert caught.value.param == "prompt_name"


def test_a_prompted_text_is_cut_with_its_prompt_unless_pooling_leaves_the_prompt_out():
    cut, counts = _truncated(request(truncate_prompt_tokens=4), ["1 2 3"], [7], Handler, 512, "8 ", True)
    assert cut == [[0, 2, 3, 9]] and counts == [4]
    with pytest.raises(InvalidRequest) as caught:
        _truncated(request(truncate_prompt_tokens=4), ["1 2 3"], [7], Handler, 512, "8 ", False)
    assert caught.value.param == "truncate_prompt_tokens"
