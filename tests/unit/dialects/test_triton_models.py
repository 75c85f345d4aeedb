"""Model-side pieces without a server: the model.py tensor API and the LLM's tensors -> GenerationRequest."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lmi_serve.dialects.triton.llm import parse_llm_call
from lmi_serve.dialects.triton.protocol import ERROR_TABLE as TRITON_ERROR_TABLE
from lmi_serve.errors import InvalidRequest, lookup
from lmi_serve.handler_api import Input, Output
from lmi_serve.tensor_model import (TensorSpec, add_tensors, get_tensors, read_output_tensors,
                                                    tensor_input)
from lmi_serve.tensors import WireTensor


def test_a_tensor_model_receives_and_returns_numpy_through_input_and_output():
    sent = [WireTensor("A", "INT32", (1, 2), np.array([[1, 2]], dtype=np.int32)),
            WireTensor("S", "BYTES", (2,), np.array([b"x\0", b""], dtype=object))]
    request = tensor_input(sent, {"requestId": "r"})
    tensors = get_tensors(request)
    assert tensors["A"].tolist() == [[1, 2]] and tensors["S"].tolist() == [b"x\0", b""]
    output = add_tensors(Output(), {"SUM": tensors["A"] + 1, "TEXT": np.array(["é"])})
    specs = [TensorSpec("SUM", "INT32", (-1, 2)), TensorSpec("TEXT", "BYTES", (-1,))]
    returned = read_output_tensors(output, specs, "m")
    assert [(t.name, t.datatype, t.shape) for t in returned] == [("SUM", "INT32", (1, 2)), ("TEXT", "BYTES", (1,))]
    assert returned[1].array.tolist() == ["é".encode()]


def test_batched_inputs_unpack_per_request():
    one = tensor_input([WireTensor("A", "INT8", (1,), np.array([1], dtype=np.int8))], {})
    two = tensor_input([WireTensor("A", "INT8", (1,), np.array([2], dtype=np.int8))], {})
    batch = Input.batch_of([one, two])
    assert [get_tensors(item)["A"].tolist() for item in batch.get_batches()] == [[1], [2]]


def test_outputs_must_match_the_declaration():
    specs = [TensorSpec("OUT", "INT32", (-1,))]
    widened = read_output_tensors(add_tensors(Output(), {"OUT": np.array([1, 2], dtype=np.int64)}), specs, "m")
    assert widened[0].array.dtype == np.int32  # numpy's int64 arithmetic fits the declared INT32
    with pytest.raises(ValueError, match="out of range for its declared INT32"):
        read_output_tensors(add_tensors(Output(), {"OUT": np.array([2**40])}), specs, "m")
    with pytest.raises(ValueError, match="returned output 'OUT' as FP32, but declares INT32"):
        read_output_tensors(add_tensors(Output(), {"OUT": np.array([1.5], dtype=np.float32)}), specs, "m")
    with pytest.raises(ValueError, match="which OUTPUT_TENSORS does not declare"):
        read_output_tensors(add_tensors(Output(), {"OTHER": np.array([1])}), specs, "m")


def test_a_plain_body_is_never_taken_for_a_tensor():
    request = Input.from_http(b'{"INPUT0": 1}', {}, [("INPUT0", "not a tensor")], "r")
    with pytest.raises(ValueError, match="content entry 'INPUT0' is not a tensor"):
        get_tensors(request)
    with pytest.raises(ValueError):
        TensorSpec("X", "INT33")


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer):
    return SimpleNamespace(tokenizer=smollm2_tokenizer, eos_token_ids=frozenset({2}), max_model_len=64)


def scalar(name: str, datatype: str, value) -> WireTensor:
    dtype = {"BYTES": object, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}[datatype]
    return WireTensor(name, datatype, (1,), np.array([value], dtype=dtype))


def call(engine, *tensors: WireTensor, parameters=None, outputs=None):
    by_name = {t.name: t for t in (scalar("text_input", "BYTES", b"Hello there"), *tensors)}
    return parse_llm_call(engine, by_name, parameters or {}, outputs)


def test_llm_defaults_are_greedy_sixteen_tokens_without_the_prompt(engine):
    parsed = call(engine)
    assert parsed.request.sampling.do_sample is False and parsed.request.stop.max_new_tokens == 16
    assert parsed.exclude_input and not parsed.stream and parsed.extra_outputs == ()


def test_sampling_comes_from_parameters_or_the_sampling_parameters_tensor(engine):
    from_parameters = call(engine, parameters={"temperature": 0.7, "max_tokens": 5, "pad_id": 2})
    assert from_parameters.request.sampling.do_sample and from_parameters.request.sampling.temperature == 0.7
    assert from_parameters.request.stop.max_new_tokens == 5
    # the tensor replaces the request parameters entirely (vLLM), and its numbers may be strings (genai-perf)
    from_tensor = call(engine, scalar("sampling_parameters", "BYTES", b'{"max_tokens": "7", "stop": "\\n"}'),
                       parameters={"temperature": 0.7})
    assert from_tensor.request.stop.max_new_tokens == 7 and from_tensor.request.stop.stop_sequences == ("\n",)
    assert from_tensor.request.sampling.do_sample is False
    # dedicated tensors beat both
    dedicated = call(engine, scalar("max_tokens", "INT32", 3), scalar("sampling_parameters", "BYTES",
                                                                      b'{"max_tokens": 9}'))
    assert dedicated.request.stop.max_new_tokens == 3


def test_stop_words_and_return_flags(engine):
    words = WireTensor("stop_words", "BYTES", (2,), np.array([b"", b"."], dtype=object))
    parsed = call(engine, words, scalar("return_finish_reason", "BOOL", True),
                  scalar("return_num_output_tokens", "BOOL", True))
    assert parsed.request.stop.stop_sequences == (".",)
    assert parsed.extra_outputs == ("finish_reason", "num_output_tokens")
    assert call(engine, outputs=["text_output", "num_input_tokens"]).extra_outputs == ("num_input_tokens",)


@pytest.mark.parametrize("tensor, parameters, message", [
    (scalar("max_tokens", "INT32", 0), None, "max_tokens: "),
    (scalar("top_p", "FP32", 1.5), None, "top_p: "),
    (scalar("sampling_parameters", "BYTES", b'{"n": 2}'), None, r"unsupported key\(s\) \['n'\]"),
    (scalar("sampling_parameters", "BYTES", b"not json"), None, "must be a JSON object string"),
    (scalar("text_input", "BYTES", b"\xff\xfe"), None, "input 'text_input' must be UTF-8 text"),
    (scalar("text_input", "BYTES", b"word " * 80), None, "over the limit of 63"),
    (scalar("stream", "BOOL", False), {"temperature": "hot"}, "temperature: "),
])
def test_llm_refuses_invalid_values_with_400(engine, tensor, parameters, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        call(engine, tensor, parameters=parameters)
    assert lookup(TRITON_ERROR_TABLE, caught.value) == 400
