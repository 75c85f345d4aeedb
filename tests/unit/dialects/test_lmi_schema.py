"""LMI dynamic-batch request schema: accepted shapes, messages that name the field, do_sample rules."""

from __future__ import annotations

import pytest

from lmi_serve.dialects.common.schema import (
    DynamicBatchParameters, DynamicBatchRequest, LmiRequestError, parse_dynamic_batch_request,
)
from lmi_serve.engine.types import SamplingParams


def parse(parameters=None, inputs="Hello"):
    payload = {"inputs": inputs}
    if parameters is not None:
        payload["parameters"] = parameters
    return parse_dynamic_batch_request(payload)


def sampling(**parameters) -> SamplingParams:
    return parse(parameters).parameters.sampling()


# --- inputs ---------------------------------------------------------------------------------

def test_string_input():
    req = parse_dynamic_batch_request({"inputs": "Hello"})
    assert isinstance(req, DynamicBatchRequest)
    assert req.prompts == ["Hello"]
    assert req.parameters == DynamicBatchParameters()


def test_list_input_keeps_order():
    req = parse_dynamic_batch_request({"inputs": ["a", "b b", "c"], "parameters": {"max_new_tokens": 5}})
    assert req.prompts == ["a", "b b", "c"]
    assert req.parameters.max_new_tokens == 5


def test_bare_string_body_is_inputs():
    assert parse_dynamic_batch_request("Hi there").prompts == ["Hi there"]


def test_defaults():
    p = parse().parameters
    assert p.max_new_tokens == 30
    assert p.return_full_text is False
    assert p.stop_sequences is None
    assert p.sampling() == SamplingParams(do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
                                          repetition_penalty=1.0, seed=None)


def test_missing_inputs():
    with pytest.raises(LmiRequestError, match="inputs"):
        parse_dynamic_batch_request({"parameters": {}})


@pytest.mark.parametrize("inputs", ["", [], [""], ["ok", ""], 5, None, [1], ["ok", 2], {"text": "x"}, True])
def test_bad_inputs(inputs):
    with pytest.raises(LmiRequestError, match="'inputs'"):
        parse_dynamic_batch_request({"inputs": inputs})


@pytest.mark.parametrize("body", [["Hello"], 5, None, b"Hello"])
def test_body_must_be_an_object(body):
    with pytest.raises(LmiRequestError, match="JSON object"):
        parse_dynamic_batch_request(body)


def test_unknown_top_level_field_is_named():
    with pytest.raises(LmiRequestError, match="stream"):
        parse_dynamic_batch_request({"inputs": "x", "stream": True})
    with pytest.raises(LmiRequestError, match="prompt"):
        parse_dynamic_batch_request({"prompt": "x"})


# --- parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("parameters", ["abc", ["max_new_tokens", 5], 5, [], "", 0, False])
def test_non_dict_parameters(parameters):
    with pytest.raises(LmiRequestError, match="'parameters' must be a JSON object"):
        parse(parameters)


def test_null_parameters_means_defaults():
    req = parse_dynamic_batch_request({"inputs": "x", "parameters": None})
    assert req.parameters == DynamicBatchParameters()


def test_empty_parameters_object_means_defaults():
    assert parse({}).parameters == DynamicBatchParameters()


@pytest.mark.parametrize("name", ["details", "decoder_input_details", "max_tokens", "best_of", "typical_p"])
def test_unsupported_parameter_is_named(name):
    with pytest.raises(LmiRequestError) as info:
        parse({name: 1, "max_new_tokens": 3})
    message = str(info.value)
    assert repr(name) in message
    assert "Unsupported parameter" in message
    assert "max_new_tokens" in message  # the supported list is shown


@pytest.mark.parametrize("field,value", [
    ("temperature", -1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("max_new_tokens", 0),
    ("max_new_tokens", -5),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("top_k", -1),
    ("seed", -1),
    ("max_new_tokens", "many"),
    ("max_new_tokens", 2.5),
    ("do_sample", "perhaps"),
    ("stop_sequences", [1, 2]),
    ("stop_sequences", 5),
    ("seed", 2**63),  # torch cannot seed with it: a 500 in the engine, not a 4xx
    ("top_k", 2**63),
    ("max_new_tokens", 2**63),
    ("temperature", float("inf")),  # JSON's 1e400 decodes to infinity
    ("repetition_penalty", float("inf")),
])
def test_out_of_range_or_wrong_type_names_the_field(field, value):
    with pytest.raises(LmiRequestError) as info:
        parse({field: value})
    assert f"parameters.{field}" in str(info.value)


def test_several_errors_are_all_reported():
    with pytest.raises(LmiRequestError) as info:
        parse({"temperature": -1, "max_new_tokens": 0})
    message = str(info.value)
    assert "parameters.temperature" in message and "parameters.max_new_tokens" in message


def test_boundary_values_are_accepted():
    p = parse({"temperature": 0, "top_p": 1, "max_new_tokens": 1, "top_k": 0, "seed": 0,
               "repetition_penalty": 0.01}).parameters
    assert (p.temperature, p.top_p, p.max_new_tokens, p.seed) == (0, 1, 1, 0)


def test_numeric_strings_are_coerced():
    p = parse({"max_new_tokens": "7", "temperature": "0.5"}).parameters
    assert p.max_new_tokens == 7 and p.temperature == 0.5


def test_stop_sequences_string_becomes_list():
    assert parse({"stop_sequences": "###"}).parameters.stop_sequences == ["###"]
    assert parse({"stop_sequences": ["a", "b"]}).parameters.stop_sequences == ["a", "b"]


def test_parse_does_not_mutate_the_payload():
    params = {"stop_sequences": "###"}
    parse(params)
    assert params == {"stop_sequences": "###"}


def test_return_full_text():
    assert parse({"return_full_text": True}).parameters.return_full_text is True


def test_sampling_carries_values():
    s = sampling(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=42)
    assert s == SamplingParams(do_sample=True, temperature=0.7, top_k=40, top_p=0.9,
                               repetition_penalty=1.2, seed=42)


# --- do_sample inference (module docstring) --------------------------------------------------

@pytest.mark.parametrize("parameters,expected", [
    ({}, False),
    ({"seed": 3}, False),
    ({"repetition_penalty": 1.3}, False),
    ({"max_new_tokens": 5}, False),
    ({"temperature": 0.7}, True),
    ({"temperature": 1.0}, True),
    ({"top_k": 50}, True),
    ({"top_k": 0}, False),
    ({"top_p": 0.9}, True),
    ({"top_p": 1.0}, False),
    ({"temperature": 0}, False),
    ({"temperature": 0, "top_k": 50}, False),
    ({"temperature": 0, "top_p": 0.5}, False),
    ({"do_sample": True}, True),
    ({"do_sample": True, "temperature": 0}, False),
    ({"do_sample": False, "temperature": 0.7, "top_k": 5, "top_p": 0.5}, False),
    ({"do_sample": None, "top_p": 0.5}, True),
])
def test_do_sample_inference(parameters, expected):
    assert sampling(**parameters).do_sample is expected


def test_omitted_values_become_neutral():
    s = sampling(do_sample=True)
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed) == (1.0, 0, 1.0, 1.0, None)
