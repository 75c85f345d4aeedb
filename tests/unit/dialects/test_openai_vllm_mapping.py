"""dialects/openai/vllm.py without a model: which vLLM fields are refused, how the honoured ones
become engine parameters, and how prompt_logprobs and chat echo are rendered."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lmi_serve.dialects.openai import vllm
from lmi_serve.dialects.openai.errors import status
from lmi_serve.dialects.openai.render import ResponseMeta
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest, parse
from lmi_serve.engine.sampling.grammar import GrammarError
from lmi_serve.engine.types import GenerationRequest, GuidedDecoding, StopParams, TokenEvent, TopToken
from lmi_serve.errors import InvalidRequest

USER = [{"role": "user", "content": "hi"}]


def chat_request(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": USER, **fields})


def refused(model, body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(model, body)
    assert status(caught.value) == 400
    return caught.value


@pytest.mark.parametrize("field", sorted(vllm.REFUSED_CHAT))
def test_every_chat_refusal_names_its_field_and_accepts_its_neutral_values(field):
    reason, neutral = vllm.REFUSED_CHAT[field]
    error = refused(ChatCompletionRequest, {"messages": USER, field: "something else"})
    assert error.param == field and reason in error.message
    for value in neutral:
        request = chat_request(**{field: value})
        assert field not in (request.model_extra or {})  # accepted as a no-op, not logged as unknown


def test_completion_refusals_differ_from_chat_where_the_routes_differ():
    assert refused(CompletionRequest, {"prompt": "x", "prompt_embeds": "AAAA"}).param == "prompt_embeds"
    assert parse(CompletionRequest, {"prompt": "x", "best_of": 2}).best_of == 2  # a completions field
    assert parse(CompletionRequest, {"prompt": "x", "add_generation_prompt": False}).model_extra  # unknown there


def test_a_neutral_value_must_be_of_the_neutral_kind():
    assert refused(ChatCompletionRequest, {"messages": USER, "priority": False}).param == "priority"
    assert chat_request(length_penalty=1).model_extra == {}


def test_structured_outputs_takes_exactly_one_known_constraint():
    assert refused(ChatCompletionRequest, {"messages": USER, "structured_outputs": {}}).param == "structured_outputs"
    error = refused(ChatCompletionRequest, {"messages": USER, "structured_outputs": {"regex": "a", "xml": "b"}})
    assert error.param == "structured_outputs.xml"
    error = refused(ChatCompletionRequest, {"messages": USER, "structured_outputs": {"regex": "a",
                                                                                     "structural_tag": "{}"}})
    assert "structural_tag" in error.message


class FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class FakeGrammars:
    def __init__(self):
        self.compiled = []

    def constraint(self, guided):
        if guided.regex == "(":
            raise GrammarError("invalid regex")
        self.compiled.append(guided)


def fake_engine():
    return SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=1000)), vocab_size=1000,
                           tokenizer=FakeTokenizer(), grammars=FakeGrammars())


def extend(request, max_new_tokens=50, guided=None):
    base = GenerationRequest((1, 2, 3), stop=StopParams(max_new_tokens=max_new_tokens), guided=guided)
    return vllm.extend(fake_engine(), request, [base, base])


def test_honoured_fields_become_neutral_engine_parameters():
    request = chat_request(min_tokens=5, allowed_token_ids=[7, 8], bad_words=["ab"], skip_special_tokens=False,
                           spaces_between_special_tokens=False, prompt_logprobs=3,
                           guided_choice=["yes", "no"])
    out = extend(request)
    assert len(out) == 2 and out[0] == out[1]
    first = out[0]
    assert first.stop.min_new_tokens == 5 and first.stop.max_new_tokens == 50
    assert first.sampling.allowed_token_ids == frozenset({7, 8})
    assert set(first.sampling.banned_sequences) == {(97, 98), (32, 97, 98)}
    assert not first.detokenize.skip_special_tokens and not first.detokenize.spaces_between_special_tokens
    assert first.prompt_logprobs and first.prompt_top_n == 3
    assert first.guided == GuidedDecoding(lark='start: "yes" | "no"\n')


@pytest.mark.parametrize("body, guided", [
    ({"guided_json": {"type": "object"}}, GuidedDecoding(json_schema='{"type": "object"}')),
    ({"guided_json": '{"type": "string"}'}, GuidedDecoding(json_schema='{"type": "string"}')),
    ({"structured_outputs": {"json_object": True}}, GuidedDecoding(json_schema='{"type": "object"}')),
    ({"structured_outputs": {"regex": "[a-z]+"}}, GuidedDecoding(regex="[a-z]+")),
    ({"guided_grammar": 'start: "x"'}, GuidedDecoding(lark='start: "x"')),
])
def test_each_constraint_spelling_maps_to_one_grammar(body, guided):
    assert extend(chat_request(**body))[0].guided == guided


def test_completions_response_format_is_a_constraint_too():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = parse(CompletionRequest, {"prompt": "x", "response_format": {"type": "json_schema",
                                                                          "json_schema": {"name": "a",
                                                                                          "schema": schema}}})
    assert json.loads(extend(request)[0].guided.json_schema) == schema
    plain = parse(CompletionRequest, {"prompt": "x", "response_format": {"type": "text"}})
    assert extend(plain)[0].guided is None


@pytest.mark.parametrize("body, param", [
    ({"min_tokens": 51}, "min_tokens"),
    ({"allowed_token_ids": [1000]}, "allowed_token_ids"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}, "guided_regex"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_fields_that_cannot_apply_are_a_400_naming_them(body, param):
    with pytest.raises(InvalidRequest) as caught:
        extend(chat_request(**body))
    assert status(caught.value) == 400 and caught.value.param == param


def test_a_vllm_constraint_does_not_silently_replace_response_format_or_tools():
    with pytest.raises(InvalidRequest) as caught:
        extend(chat_request(guided_regex="a+"), guided=GuidedDecoding(json_schema="{}"))
    assert caught.value.param == "guided_regex"


def test_truncate_prompt_keeps_the_last_tokens():
    assert vllm.truncate_prompt([1, 2, 3, 4], chat_request(truncate_prompt_tokens=2), 100) == [3, 4]
    left = parse(CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 2, "truncation_side": "left"})
    assert vllm.truncate_prompt([1, 2, 3, 4], left, 100) == [3, 4]
    assert vllm.truncate_prompt([1, 2, 3, 4], chat_request(truncate_prompt_tokens=-1), 3) == [2, 3, 4]
    assert vllm.truncate_prompt([1, 2, 3, 4], chat_request(), 3) == [1, 2, 3, 4]


def test_truncation_side_right_keeps_the_first_tokens():
    right = parse(CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 2, "truncation_side": "right"})
    assert vllm.truncate_prompt([1, 2, 3, 4], right, 100) == [1, 2]
    assert vllm.truncate_prompt([1, 2, 3, 4], chat_request(truncate_prompt_tokens=-1, truncation_side="right"), 3) \
        == [1, 2, 3]
    assert refused(CompletionRequest, {"prompt": "x", "truncation_side": "middle"}).param == "truncation_side"
    assert parse(CompletionRequest, {"prompt": "x", "truncation_side": "right"}).model_extra == {}  # not logged


def test_logprob_token_ids_are_refused_naming_the_field():
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": USER})):
        assert refused(model, {**body, "logprob_token_ids": [5, 7]}).param == "logprob_token_ids"
        assert parse(model, {**body, "logprob_token_ids": []}).model_extra == {}


def test_prompt_logprobs_render_in_vllms_shape():
    prompt = (TopToken(5, "a", None), TopToken(6, "b", -1.5, rank=2), TopToken(7, "c", float("-inf"), rank=900))
    alternatives = ((), (TopToken(9, "z", -0.2, rank=1), TopToken(6, "b", -1.5, rank=2)),
                    (TopToken(9, "z", -0.1, rank=1), TopToken(3, "y", -3.0, rank=2)))
    event = TokenEvent(1, "x", -0.5, False, prompt_tokens=prompt, prompt_top_tokens=alternatives)
    rendered = vllm.prompt_logprobs(event)
    assert rendered[0] is None
    assert rendered[1] == {"6": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
                           "9": {"logprob": -0.2, "rank": 1, "decoded_token": "z"}}
    assert list(rendered[2]) == ["7", "9", "3"] and rendered[2]["7"]["logprob"] == -9999.0
    json.dumps(rendered, allow_nan=False)  # valid JSON: no -Infinity
    only_tokens = vllm.prompt_logprobs(TokenEvent(1, "x", -0.5, False, prompt_tokens=prompt))
    assert [list(p) if p else p for p in only_tokens] == [None, ["6"], ["7"]]


def test_chat_echo_follows_the_role_chunk_of_each_choice():
    request = chat_request(echo=True, messages=[*USER, {"role": "assistant", "content": "Sure:"}])
    chunks = [{"id": "c", "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]} for i in (0, 1)]
    chunks.insert(1, {"id": "c", "choices": [{"index": 0, "delta": {"content": " ok"}}]})
    out = list(vllm.echo_chunks(iter(chunks), request))
    contents = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content")) for c in out]
    assert contents == [(0, ""), (0, "Sure:"), (0, " ok"), (1, ""), (1, "Sure:")]
    assert vllm.echo_text(chat_request(echo=True)) == ""  # the last message is the user's


def test_request_id_names_the_response():
    meta = ResponseMeta("chatcmpl-123", 0, "m")
    assert vllm.response_meta(meta, chat_request(request_id="mine")).id == "chatcmpl-mine"
    assert vllm.response_meta(meta, chat_request()) is meta
