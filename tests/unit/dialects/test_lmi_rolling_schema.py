"""LMI rolling-batch schema: strict body shape, every parameter rule, translation to neutral requests."""

from __future__ import annotations

import pytest

from lmi_serve.dialects.common.schema import (
    GenerationParameters, LmiRequestError, RollingRequest, parse_generation_parameters, parse_rolling_request,
    to_generation_requests,
)
from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest

EOS = frozenset({2})


def params(**parameters) -> GenerationParameters:
    return parse_rolling_request({"inputs": "Hello", "parameters": parameters}).parameters


def reject(match: str, **parameters) -> None:
    with pytest.raises(LmiRequestError, match=match):
        params(**parameters)


def translate(parameters: GenerationParameters, prompt=(5, 6, 7, 8), *, max_model_len=100,
              max_input_len=50) -> list[GenerationRequest]:
    return to_generation_requests(parameters, prompt, eos_token_ids=EOS, max_model_len=max_model_len,
                                  max_input_len=max_input_len)


# --- body shape -----------------------------------------------------------------------------

def test_minimal_body():
    req = parse_rolling_request({"inputs": "Hello"})
    assert req == RollingRequest("Hello", GenerationParameters(), False)
    assert req.parameters.max_new_tokens == 30


def test_full_body():
    req = parse_rolling_request({"inputs": "Hi", "parameters": {"max_new_tokens": 5, "details": True},
                                 "stream": True})
    assert req.inputs == "Hi" and req.stream is True
    assert req.parameters.max_new_tokens == 5 and req.parameters.details is True


def test_rolling_request_is_frozen():
    req = parse_rolling_request({"inputs": "Hi"})
    with pytest.raises(AttributeError):
        req.inputs = "other"  # type: ignore[misc]


@pytest.mark.parametrize("body", ["Hello", ["Hello"], 3, None])
def test_body_must_be_object(body):
    with pytest.raises(LmiRequestError, match="JSON object"):
        parse_rolling_request(body)


def test_missing_inputs():
    with pytest.raises(LmiRequestError, match="Missing required field 'inputs'"):
        parse_rolling_request({"parameters": {}})


def test_list_inputs_rejected():
    with pytest.raises(LmiRequestError, match="no client-side batching with rolling batch"):
        parse_rolling_request({"inputs": ["a", "b"]})


@pytest.mark.parametrize("inputs", [3, None, {"a": 1}, True])
def test_non_string_inputs(inputs):
    with pytest.raises(LmiRequestError, match="'inputs' must be a string"):
        parse_rolling_request({"inputs": inputs})


def test_empty_inputs():
    with pytest.raises(LmiRequestError, match="must not be empty"):
        parse_rolling_request({"inputs": ""})


@pytest.mark.parametrize("value", [[], "x", 0, False, [1]])
def test_parameters_must_be_object(value):
    with pytest.raises(LmiRequestError, match="'parameters' must be a JSON object"):
        parse_rolling_request({"inputs": "x", "parameters": value})


def test_null_parameters_and_stream_are_defaults():
    req = parse_rolling_request({"inputs": "x", "parameters": None, "stream": None})
    assert req.parameters == GenerationParameters() and req.stream is False


@pytest.mark.parametrize("value", ["true", 1, "yes"])
def test_stream_must_be_bool(value):
    with pytest.raises(LmiRequestError, match="'stream' must be true or false"):
        parse_rolling_request({"inputs": "x", "stream": value})


def test_unknown_top_level_field():
    with pytest.raises(LmiRequestError, match=r"Unsupported field\(s\) \['adapter_alias'\]"):
        parse_rolling_request({"inputs": "x", "adapter_alias": "a"})


@pytest.mark.parametrize("payload", [
    {"inputs": "x", "adapters": "a"}, {"inputs": "x", "adapters": ["a"]},
    {"inputs": "x", "parameters": {"adapters": "a"}}, {"inputs": "x", "parameters": {"adapters": ["a"]}},
])
def test_an_adapter_at_the_top_level_or_in_parameters(payload):
    assert parse_rolling_request(payload).parameters.adapter == "a"
    assert parse_rolling_request({"inputs": "x"}).parameters.adapter is None


@pytest.mark.parametrize("payload, match", [
    ({"inputs": "x", "adapters": "a", "parameters": {"adapters": "b"}}, "either at the top level or in"),
    ({"inputs": "x", "adapters": ["a", "b"]}, "one adapter per input"),
    ({"inputs": "x", "parameters": {"adapters": ""}}, "must not be empty"),
])
def test_bad_adapter_choices_are_refused(payload, match):
    with pytest.raises(LmiRequestError, match=match):
        parse_rolling_request(payload)


# --- parameters: names ----------------------------------------------------------------------

def test_unknown_parameter_is_named_with_supported_list():
    with pytest.raises(LmiRequestError) as info:
        params(max_tokens=5, foo=1)
    message = str(info.value)
    assert "['foo', 'max_tokens']" in message
    assert "supported:" in message and "'max_new_tokens'" in message and "'top_p'" in message


def test_stop_alias_and_single_string():
    assert params(stop=["a", "b"]).stop_sequences == ["a", "b"]
    assert params(stop_sequences="end").stop_sequences == ["end"]
    assert params(stop="end").stop_sequences == ["end"]


def test_stop_and_stop_sequences_together():
    reject("either 'stop_sequences' or 'stop'", stop=["a"], stop_sequences=["b"])


def test_empty_stop_string_rejected():
    reject("parameters.stop_sequences: stop sequences must be non-empty", stop_sequences=["a", ""])


def test_null_values_mean_unset():
    assert params(max_new_tokens=None, top_p=None, seed=None) == GenerationParameters()


def test_text_generation_client_body_is_accepted():
    """What `text_generation.Client.generate` sends: every field, most of them null."""
    text_generation = pytest.importorskip("text_generation.types")
    request = text_generation.Request(inputs="Hello", stream=False, parameters=text_generation.Parameters(
        details=True, max_new_tokens=5, stop=[], do_sample=False))
    req = parse_rolling_request(request.model_dump())  # what the client posts (it calls .dict())
    assert req.parameters.max_new_tokens == 5 and req.parameters.details is True
    assert req.parameters.stop_sequences == [] and req.parameters.do_sample_resolved is False


def test_watermark_reaches_the_rows_sampling_but_not_beam_search():
    assert params(watermark=False).sampling(None).watermark is False
    assert params(watermark=True).sampling(None).watermark is True
    assert params(watermark=True, do_sample=True).sampling(3).watermark is True
    reject("parameters.watermark: a watermark cannot be combined with beam search", watermark=True, num_beams=2)


def test_output_formatter_must_be_registered():
    assert params(output_formatter="sse").output_formatter == "sse"
    reject(r"parameters.output_formatter: unknown output formatter 'xml'; choose one of \['json', 'jsonlines', "
           r"'sse'\]", output_formatter="xml")


# --- parameters: ranges ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("temperature", -0.1), ("repetition_penalty", 0), ("top_k", -2), ("top_p", 0), ("top_p", 1.01),
    ("typical_p", 0), ("typical_p", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", 2.1),
    ("presence_penalty", -2.1), ("frequency_penalty", 2.5), ("frequency_penalty", -3), ("max_new_tokens", 0),
    ("top_n_tokens", 21), ("top_n_tokens", -1), ("n", 0), ("n", 17), ("best_of", 0), ("best_of", 17),
    ("num_beams", 0), ("num_beams", 9), ("truncate", 0), ("stop_token_ids", [-1]), ("stop_token_ids", "x"),
    ("details", "maybe"), ("max_new_tokens", 2.5),
    # past int64 (or int32 for counts and token ids) the engine's tensors overflow: a 500, not a 4xx
    ("seed", 2**63), ("top_k", 2**31), ("top_k", 2**63), ("max_new_tokens", 2**63), ("truncate", 2**63),
    ("stop_token_ids", [2**63]), ("temperature", float("inf")), ("repetition_penalty", float("inf")),
    ("top_k", "5x"),
])
def test_out_of_range(field, value):
    reject(rf"parameters\.{field}", **{field: value})


@pytest.mark.parametrize("field, value", [
    ("seed", 0), ("temperature", 0), ("top_k", 0), ("top_k", -1), ("top_p", 1), ("typical_p", 1), ("min_p", 0),
    ("min_p", 1), ("presence_penalty", -2), ("frequency_penalty", 2), ("top_n_tokens", 20), ("n", 16),
    ("num_beams", 8), ("truncate", 1), ("stop_token_ids", [0, 7]), ("ignore_eos_token", True),
    ("include_stop_str_in_output", True), ("decoder_input_details", True), ("return_full_text", True),
    ("seed", 2**63 - 1), ("top_k", 2**31 - 1), ("max_new_tokens", 2**31 - 1),
])
def test_in_range(field, value):
    extra = {"do_sample": True} if field == "n" else {}
    assert getattr(params(**{field: value}, **extra), field) == value


def test_error_message_names_field():
    with pytest.raises(LmiRequestError, match=r"^parameters\.top_p: Input should be greater than 0"):
        params(top_p=0)


# --- do_sample inference --------------------------------------------------------------------

@pytest.mark.parametrize("given, expected", [
    ({}, False),
    ({"temperature": 0.7}, True),
    ({"temperature": 1.0}, True),
    ({"top_k": 5}, True),
    ({"top_k": 0}, False),
    ({"top_k": -1}, False),
    ({"top_p": 0.9}, True),
    ({"top_p": 1.0}, False),
    ({"typical_p": 0.5}, True),
    ({"min_p": 0.1}, True),
    ({"min_p": 0.0}, False),
    ({"do_sample": True}, True),
    ({"do_sample": False, "temperature": 0.7}, False),
    ({"temperature": 0}, False),
    ({"temperature": 0, "do_sample": True}, False),
    ({"temperature": 0, "top_k": 5}, False),
    ({"repetition_penalty": 1.2}, False),
])
def test_do_sample_inference(given, expected):
    assert params(**given).do_sample_resolved is expected


# --- cross-field rules ----------------------------------------------------------------------

def test_n_needs_sampling():
    reject("n > 1 or best_of > 1 needs sampling", n=2)
    reject("needs sampling", best_of=2)
    assert params(n=2, do_sample=True).n == 2
    assert params(best_of=3, temperature=0.8).best_of == 3


def test_best_of_at_least_n():
    reject(r"parameters.best_of: must be >= n \(got best_of=2, n=3\)", n=3, best_of=2, do_sample=True)
    assert params(n=2, best_of=2, do_sample=True).num_sequences == 2
    assert params(n=2, best_of=4, do_sample=True).num_sequences == 4


def test_num_beams_rules():
    assert params(num_beams=2, n=2).num_beams == 2  # beam search needs no sampling for n > 1
    reject("cannot be combined with sampling", num_beams=2, do_sample=True)
    reject("cannot be combined with sampling", num_beams=2, temperature=0.5)
    with pytest.raises(LmiRequestError, match="num_beams.*only supported for non-streaming"):
        parse_rolling_request({"inputs": "x", "parameters": {"num_beams": 2}, "stream": True})


@pytest.mark.parametrize("parameters", [{"n": 2, "do_sample": True}, {"best_of": 2, "do_sample": True}])
def test_several_sequences_not_with_streaming(parameters):
    with pytest.raises(LmiRequestError, match="only supported for non-streaming requests"):
        parse_rolling_request({"inputs": "x", "parameters": parameters, "stream": True})


def test_parse_generation_parameters_directly():
    assert parse_generation_parameters(None) == GenerationParameters()
    with pytest.raises(LmiRequestError, match="non-streaming"):
        parse_generation_parameters({"n": 2, "do_sample": True}, stream=True)


# --- to_generation_requests -----------------------------------------------------------------

def test_defaults_translate_to_one_greedy_request():
    [req] = translate(params())
    assert req.prompt_ids == (5, 6, 7, 8)
    assert req.sampling == SamplingParams(do_sample=False, seed=None)
    assert req.stop == StopParams(max_new_tokens=30, eos_token_ids=EOS)
    assert req.top_n_tokens == 0 and req.prompt_logprobs is False


def test_all_parameters_are_mapped():
    p = params(do_sample=True, seed=7, temperature=0.5, repetition_penalty=1.3, top_k=40, top_p=0.9, typical_p=0.8,
               min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5, max_new_tokens=12, stop=["\n\n"],
               ignore_eos_token=True, stop_token_ids=[9, 10], include_stop_str_in_output=True, top_n_tokens=3,
               decoder_input_details=True)
    [req] = translate(p)
    assert req.sampling == SamplingParams(do_sample=True, temperature=0.5, top_k=40, top_p=0.9, typical_p=0.8,
                                          min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                                          frequency_penalty=-0.5, seed=7)
    assert req.stop == StopParams(max_new_tokens=12, stop_sequences=("\n\n",), stop_token_ids=frozenset({9, 10}),
                                  eos_token_ids=EOS, ignore_eos=True, include_stop_str_in_output=True)
    assert req.top_n_tokens == 3 and req.prompt_logprobs is True


def test_neutral_values_for_off_switches():
    [req] = translate(params(top_k=-1, temperature=0))
    assert req.sampling.top_k == 0 and req.sampling.temperature == 1.0 and req.sampling.do_sample is False


def test_truncate_keeps_last_ids():
    [req] = translate(params(truncate=2))
    assert req.prompt_ids == (7, 8)
    [req] = translate(params(truncate=10))
    assert req.prompt_ids == (5, 6, 7, 8)


def test_input_too_long():
    with pytest.raises(InvalidRequest, match="^Input has 4 tokens, over the limit of 3$"):
        translate(params(), max_input_len=3)
    [req] = translate(params(truncate=3), max_input_len=3)  # truncation happens first
    assert len(req.prompt_ids) == 3


def test_no_room_to_generate():
    with pytest.raises(LmiRequestError, match="leaves no room"):
        translate(params(), max_model_len=4)


def test_empty_prompt():
    with pytest.raises(InvalidRequest, match="no tokens"):
        translate(params(), prompt=())


def test_refusals_are_invalid_requests():
    # Every dialect's table renders an InvalidRequest; the dynamic-batch path catches ValueError.
    with pytest.raises(InvalidRequest) as caught:
        params(top_k="many")
    assert isinstance(caught.value, ValueError) and caught.value.message.startswith("parameters.top_k: ")
    for kwargs in ({"max_input_len": 3}, {"max_model_len": 4}):
        with pytest.raises(InvalidRequest) as caught:
            translate(params(), **kwargs)
        assert caught.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest) as caught:
        translate(params(), prompt=())
    assert caught.value.code is None


def test_over_the_input_limit_beats_no_room():
    # A prompt over max_input_len that also fills the context is refused for the input limit.
    with pytest.raises(InvalidRequest, match="over the limit of 3"):
        translate(params(), max_input_len=3, max_model_len=4)


def test_max_new_tokens_capped_to_context():
    [req] = translate(params(max_new_tokens=500), max_model_len=10)
    assert req.stop.max_new_tokens == 6
    [req] = translate(params(max_new_tokens=3), max_model_len=10)
    assert req.stop.max_new_tokens == 3


def test_seeded_sequences_use_consecutive_seeds():
    reqs = translate(params(n=2, best_of=3, seed=100, do_sample=True))
    assert [r.sampling.seed for r in reqs] == [100, 101, 102]
    assert all(r.sampling.do_sample for r in reqs)
    assert translate(params(n=2, best_of=3, seed=100, do_sample=True)) == reqs


def test_unseeded_sampled_request_gets_one_random_base_seed():
    reqs = translate(params(n=3, do_sample=True))
    base = reqs[0].sampling.seed
    assert isinstance(base, int) and base >= 0
    assert [r.sampling.seed for r in reqs] == [base, (base + 1) % 2**63, (base + 2) % 2**63]


def test_sequence_seeds_wrap_within_the_accepted_seed_range():
    reqs = translate(params(best_of=3, seed=2**63 - 2, do_sample=True))
    assert [r.sampling.seed for r in reqs] == [2**63 - 2, 2**63 - 1, 0]


def test_greedy_request_reports_no_seed():
    [req] = translate(params(seed=5))
    assert req.sampling.seed is None


def test_beam_search_is_one_request_for_the_engine():
    (request,) = translate(params(num_beams=3))
    assert request.sampling.do_sample is False
