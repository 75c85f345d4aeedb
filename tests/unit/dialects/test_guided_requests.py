"""Grammars clients send -> GuidedDecoding (`lmi_serve.dialects.common.guided`), from every dialect's field: TGI's
`parameters.grammar`, OpenAI's `response_format` in OpenAI's and TGI's forms, vLLM's fields."""

from __future__ import annotations

import json

import pytest

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.common.schema import parse_generation_parameters, to_generation_requests
from lmi_serve.dialects.openai import chat
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.dialects.tgi.protocol import parse_request
from lmi_serve.engine.sampling.grammar import GrammarCompiler, GrammarError
from lmi_serve.engine.types import GuidedDecoding
from lmi_serve.errors import InvalidRequest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_schema_as_an_object_or_as_json_text():
    assert json.loads(guided.json_schema(SCHEMA, "p").json_schema) == SCHEMA
    assert json.loads(guided.json_schema(json.dumps(SCHEMA), "p").json_schema) == SCHEMA


def test_a_bare_empty_schema_is_any_object():
    assert json.loads(guided.json_schema({}, "p").json_schema) == {"type": "object"}
    assert json.loads(guided.json_schema("{}", "p").json_schema) == {"type": "object"}


@pytest.mark.parametrize("value, words", [("{not json", "not valid JSON"), ("[1]", "must be an object"),
                                          (3, "must be an object"), (True, "boolean schema")])
def test_a_schema_that_is_not_an_object_is_refused_naming_the_field(value, words):
    with pytest.raises(InvalidRequest) as caught:
        guided.json_schema(value, "parameters.grammar.value")
    assert words in caught.value.message and caught.value.param == "parameters.grammar.value"
    assert caught.value.message.startswith("parameters.grammar.value: ")


@pytest.mark.parametrize("value", ["", None, 5, ["a"]])
def test_a_regex_must_be_a_non_empty_string(value):
    with pytest.raises(InvalidRequest) as caught:
        guided.regex(value, "response_format.value")
    assert caught.value.param == "response_format.value"
    assert guided.regex("[0-9]+", "p") == GuidedDecoding(regex="[0-9]+")


class RefusingEngine:
    def generate(self, requests):
        raise GrammarError("invalid schema: unknown keyword")


def test_the_compilers_refusal_is_an_invalid_request_naming_the_field():
    with pytest.raises(InvalidRequest) as caught:
        guided.generate(RefusingEngine(), [], "parameters.grammar")
    assert caught.value.param == "parameters.grammar"
    assert caught.value.message == "parameters.grammar: invalid or unsupported schema, pattern or grammar: invalid schema: unknown keyword"


# --- TGI's parameters.grammar -----------------------------------------------------------------

def tgi_requests(grammar, n=1):
    body = {"inputs": "Hi", "parameters": {"grammar": grammar, "max_new_tokens": 4, **(
        {"n": n, "do_sample": True} if n > 1 else {})}}
    parsed = parse_request(json.dumps(body).encode(), default_full_text=False, stream_route=False)
    return to_generation_requests(parsed.parameters, [1, 2, 3], eos_token_ids=frozenset({2}), max_model_len=100,
                                  max_input_len=99)


def test_tgi_grammar_json_regex_and_json_schema_become_the_rows_constraint():
    assert json.loads(tgi_requests({"type": "json", "value": SCHEMA})[0].guided.json_schema) == SCHEMA
    assert json.loads(tgi_requests({"type": "json", "value": {}})[0].guided.json_schema) == {"type": "object"}
    assert json.loads(tgi_requests({"type": "json", "value": json.dumps(SCHEMA)})[0].guided.json_schema) == SCHEMA
    assert tgi_requests({"type": "regex", "value": "[a-z]+"})[0].guided == GuidedDecoding(regex="[a-z]+")
    named = {"type": "json_schema", "value": {"name": "person", "schema": SCHEMA}}
    assert json.loads(tgi_requests(named)[0].guided.json_schema) == SCHEMA
    assert all(r.guided == GuidedDecoding(regex="a+") for r in tgi_requests({"type": "regex", "value": "a+"}, n=3))
    assert tgi_requests(None)[0].guided is None


@pytest.mark.parametrize("grammar, param", [
    ({"type": "lark", "value": "start: x"}, "parameters.grammar.type"),
    ({"type": "json"}, "parameters.grammar.value"),
    ({"type": "json", "value": SCHEMA, "extra": 1}, "parameters.grammar.extra"),
    ({"type": "regex", "value": ""}, "parameters.grammar.value"),
    ({"type": "json", "value": "{oops"}, "parameters.grammar.value"),
    ({"type": "json_schema", "value": SCHEMA}, "parameters.grammar.value"),
    ("json", "parameters.grammar"),
])
def test_a_bad_tgi_grammar_is_refused_naming_the_field(grammar, param):
    with pytest.raises(InvalidRequest) as caught:
        tgi_requests(grammar)
    assert param in caught.value.message


def test_a_grammar_cannot_steer_beam_search():
    with pytest.raises(InvalidRequest) as caught:
        parse_generation_parameters({"grammar": {"type": "regex", "value": "a"}, "num_beams": 2})
    assert "parameters.grammar" in caught.value.message


def test_tgi_grammars_compile(smollm2_tokenizer):
    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    for grammar in ({"type": "json", "value": SCHEMA}, {"type": "json", "value": {}},
                    {"type": "regex", "value": "(yes|no)"}):
        assert compiler.constraint(tgi_requests(grammar)[0].guided) is not None
    with pytest.raises(GrammarError):
        compiler.constraint(tgi_requests({"type": "regex", "value": "(unclosed"})[0].guided)


# --- the Messages API's response_format ---------------------------------------------------------

def chat_guided(response_format) -> GuidedDecoding | None:
    return chat.guided_decoding(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                              "response_format": response_format}))


def test_response_format_in_tgis_forms_is_honoured():
    # huggingface_hub rewrites OpenAI's json_schema into this form for TGI
    assert json.loads(chat_guided({"type": "json_object", "value": SCHEMA}).json_schema) == SCHEMA
    assert json.loads(chat_guided({"type": "json", "value": SCHEMA}).json_schema) == SCHEMA
    assert chat_guided({"type": "regex", "value": "[0-9]{3}"}) == GuidedDecoding(regex="[0-9]{3}")
    tgi_schema = {"type": "json_schema", "value": {"name": "p", "schema": SCHEMA}}
    assert json.loads(chat_guided(tgi_schema).json_schema) == SCHEMA
    assert json.loads(chat_guided({"type": "json_object"}).json_schema) == {"type": "object"}


@pytest.mark.parametrize("response_format, param", [
    ({"type": "text", "value": SCHEMA}, "response_format"),
    ({"type": "json"}, "response_format"),
    ({"type": "regex"}, "response_format"),
    ({"type": "json_object", "value": "{bad"}, "response_format.value"),
    ({"type": "regex", "value": 7}, "response_format.value"),
])
def test_a_bad_response_format_is_refused_naming_the_field(response_format, param):
    with pytest.raises(InvalidRequest) as caught:
        chat_guided(response_format)
    assert caught.value.param == param, caught.value.message


def test_a_regex_response_format_cannot_be_combined_with_tools():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidRequest) as caught:
        chat.guided_decoding(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                           "tools": [tool],
                                                           "response_format": {"type": "regex", "value": "a"}}))
    assert caught.value.param == "response_format"
