"""The generate extension without a model: body -> tensors/parameters, shapes, responses and SSE frames."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmi_serve.dialects.triton.generate import (deduce_shape, dumps, parse_generate_request, response_object,
                                                sse_events)
from lmi_serve.dialects.triton.llm import LLM_INPUTS, LLM_OUTPUTS
from lmi_serve.dialects.triton.models import ModelContract
from lmi_serve.dialects.triton.protocol import TritonError
from lmi_serve.errors import GenerationFailed
from lmi_serve.tensor_model import TensorSpec
from lmi_serve.tensors import WireTensor

LLM = ModelContract("llm", LLM_INPUTS, LLM_OUTPUTS, lenient_single_elements=True)


def parse(body: str | bytes):
    return parse_generate_request(body.encode() if isinstance(body, str) else body, "llm", LLM)


def test_model_inputs_become_tensors_and_other_keys_parameters():
    request = parse('{"text_input": "hi", "max_tokens": 8, "stream": false, "id": "42", "pad_id": 2}')
    tensors = {t.name: t for t in request.tensors}
    assert tensors["text_input"].array.tolist() == [b"hi"] and tensors["text_input"].shape == (1,)
    assert tensors["max_tokens"].array.dtype == np.int32 and tensors["stream"].array.tolist() == [False]
    assert request.parameters == {"id": "42", "pad_id": 2} and request.request_id == "42"


def test_text_input_may_be_a_one_element_list_and_parameters_map_one_level_deep():
    request = parse('{"text_input": ["hi"], "parameters": {"temperature": 0, "max_tokens": 3, "seed": 1}}')
    assert {t.name: t.array.tolist() for t in request.tensors} == {"text_input": [b"hi"], "temperature": [0.0],
                                                                   "max_tokens": [3]}
    assert request.parameters == {"seed": 1}


def test_an_empty_body_maps_to_nothing_and_fails_later_on_missing_inputs():
    request = parse(b"")
    assert request.tensors == [] and request.parameters == {}


@pytest.mark.parametrize("shape, count, expected", [
    ((-1, 1), 1, (1, 1)), ((1, -1), 2, (1, 2)), ((-1, -1), 1, (1, 1)), ((1,), 1, (1,)), ((-1, 16), 0, (0, 16)),
])
def test_shapes_are_deduced_from_the_model_shape(shape, count, expected):
    assert deduce_shape(TensorSpec("X", "INT32", shape), count) == expected


def test_a_count_that_does_not_fit_the_shape_is_refused():
    with pytest.raises(TritonError, match="The schema can not convert input 'text_input' to tensor with proper shape"):
        parse('{"text_input": ["a", "b"]}')


@pytest.mark.parametrize("body, message", [
    ('{"text_input": 123}', "attempt to access JSON non-string as string"),
    ('{"stream": "false"}', "attempt to access JSON non-boolean as boolean"),
    ('{"stream": "false", "text_input": 123}', "attempt to access JSON non-boolean as boolean"),  # body order
    ('{"text_input": 123, "stream": "false"}', "attempt to access JSON non-string as string"),
    ('{"text_input": {"a": 1}}', "attempt to access JSON non-string as string"),
    ('{"PARAMS": {"a": 1}}', "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ('{"text_input": "a", "text_input": "b"}', "input 'text_input' already exists in request"),
    ('{"stream": true, "text_input": "a", "stream": false, "text_input": "b"}', "input 'stream' already exists"),
    ('{"text_input": "a", "parameters": {"text_input": "b"}}', "input 'text_input' already exists in request"),
    ('{"parameters": 1}', "Expected JSON object for keyword: 'parameters'"),
    ('{"parameters": {"nested": {"a": 1}}}', "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
])
def test_mapping_errors_use_tritons_messages(body, message):
    with pytest.raises(TritonError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        parse(body)
    assert caught.value.status == 400


def test_one_element_outputs_are_bare_values_and_others_flat_arrays():
    outputs = [WireTensor("text_output", "BYTES", (1,), np.array([b"Paris"], dtype=object)),
               WireTensor("OUTPUT0", "INT32", (1, 2), np.array([[1, 2]], dtype=np.int32)),
               WireTensor("TEXT", "BYTES", (0,), np.array([], dtype=object))]
    body = response_object("llm", "", outputs)
    assert body == {"model_name": "llm", "model_version": "1", "text_output": "Paris", "OUTPUT0": [1, 2], "TEXT": []}
    assert "id" not in body and response_object("llm", "42", outputs)["id"] == "42"
    assert dumps(body).startswith('{"OUTPUT0":[1,2],"TEXT":[],"model_name":"llm"')  # compact, keys in byte order


def text(value: str) -> list[WireTensor]:
    return [WireTensor("text_output", "BYTES", (1,), np.array([value.encode()], dtype=object))]


def test_sse_frames_are_data_lines_only_and_an_error_ends_the_stream():
    closed = []

    def responses():
        try:
            yield text("Hello")
            yield text(" world")
            raise GenerationFailed("An Error Occurred")  # the model failed after its first response
        finally:
            closed.append(True)

    frames = list(sse_events("llm", "", responses()))
    assert frames == ['data: {"model_name":"llm","model_version":"1","text_output":"Hello"}\n\n',
                      'data: {"model_name":"llm","model_version":"1","text_output":" world"}\n\n',
                      'data: {"error":"An Error Occurred"}\n\n']
    assert closed == [True]


def test_a_triton_protocol_error_mid_stream_and_a_lone_surrogate_end_the_stream_as_an_error_event():
    def responses(error):
        yield text("Hi")
        raise error

    for error, message in ((TritonError(400, "bad tensor"), "bad tensor"),
                           (GenerationFailed("bad \ud800 text"), "bad \\ud800 text")):
        frames = list(sse_events("llm", "", responses(error)))
        assert frames[-1].startswith('data: {"error":') and frames[-1].endswith("}\n\n")
        assert json.loads(frames[-1].removeprefix("data: "))["error"] == message
        frames[-1].encode("utf-8")  # a lone surrogate from the model must not break the response


def test_closing_the_sse_stream_closes_the_model_responses():
    closed = []

    def responses():
        try:
            while True:
                yield text("x")
        finally:
            closed.append(True)  # the LLM runner cancels its engine request here

    events = sse_events("llm", "", responses())
    next(events), next(events)
    events.close()
    assert closed == [True]


def llm_stream(*events):
    """A streaming LLM call whose engine already pushed `events` to its one sequence."""
    import queue

    from lmi_serve.dialects.triton.llm import LlmCall
    from lmi_serve.dialects.triton.runners import ModelStream, _llm_responses
    from lmi_serve.engine.generation import Generation
    from lmi_serve.engine.handle import RequestHandle
    from lmi_serve.engine.types import GenerationRequest

    sink = queue.SimpleQueue()
    handle = RequestHandle(GenerationRequest(prompt_ids=(1, 2, 3)), None, sink=sink)
    for event in events:
        handle.push(event)
    call = LlmCall("prompt", handle.request, True, True, (), (1,))
    generation = Generation([handle], sink)
    return ModelStream(_llm_responses(call, generation), generation), handle


def test_a_failure_before_the_first_token_raises_its_kind_at_start():
    from lmi_serve.engine.types import TokenEvent
    from lmi_serve.errors import Timeout

    stream, handle = llm_stream(TokenEvent.failure("waited too long", kind=Timeout))
    with pytest.raises(Timeout, match="waited too long"):
        stream.start()
    assert handle.cancelled


def test_start_keeps_the_first_event_for_the_stream_and_close_cancels_an_unread_stream():
    from lmi_serve.engine.types import FinishReason, TokenEvent

    stream, handle = llm_stream(TokenEvent(5, "Hi", -0.1, False), TokenEvent(6, "!", -0.1, False, FinishReason.LENGTH))
    stream.start()
    assert [tensors[0].array.tolist() for tensors in stream] == [[b"Hi"], [b"!"]]

    unread, handle = llm_stream(TokenEvent(5, "Hi", -0.1, False))
    unread.start()
    assert not handle.cancelled
    unread.close()  # the client left before the body was read: no generator ever ran
    assert handle.cancelled
