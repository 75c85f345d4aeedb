"""The OpenAI dialect's pure parts: request validation, chat rendering and grammars, tool-call
parsing, context limits, and the stream/body renderers."""

from __future__ import annotations

import json

import pytest

from lmi_serve.dialects.openai import chat
from lmi_serve.dialects.openai.errors import status
from lmi_serve.dialects.openai.generation import ChoiceState, fit_to_context
from lmi_serve.dialects.openai.render import (ChatStream, CompletionChoice, ResponseMeta, chat_completion,
                                              completion, completion_chunk)
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse
from lmi_serve.engine.types import FinishReason, TokenEvent, TopToken
from lmi_serve.errors import InvalidRequest

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time"}}


def chat_request(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": USER, **fields})


def bad(model, body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(model, body)
    assert status(caught.value) == 400
    return caught.value


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"stop": ["a", ""]}, "stop"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"tools": [TOOL] * 33}, "tools"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_field_errors_name_the_field(fields, param):
    error = bad(ChatCompletionRequest, {"messages": USER, **fields})
    assert error.param.startswith(param) and "validation error" in error.message


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("fields, param", [
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"top_k": 2**63}, "top_k"),
    ({"top_k": -2}, "top_k"), ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"), ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"), ({"n": 2**64}, "n"), ({"max_tokens": -2**64}, "max_tokens"),
])
def test_integers_beyond_int64_or_their_range_are_400_naming_the_field(model, fields, param):
    base = {"messages": USER} if model is ChatCompletionRequest else {"prompt": "hi"}
    error = bad(model, {**base, **fields})
    assert error.param.startswith(param)


def test_int64_seeds_and_top_k_are_accepted_negative_seeds_too():
    for seed in (-2**63, -1, 0, 2**63 - 1):
        assert chat_request(seed=seed).seed == seed
    assert chat_request(top_k=2**63 - 1).top_k == 2**63 - 1
    assert chat_request(logit_bias={"-5": 1, "49151": -100}).logit_bias == {"-5": 1, "49151": -100}


@pytest.mark.parametrize("fields, words", [
    ({"n": 2, "temperature": 0}, "n > 1"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream is true"),
    ({"tools": []}, "empty"),
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"response_format": {"type": "json_schema"}}, "json_schema object"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "url"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "user messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
    ({"messages": [{"role": "user"}]}, "needs content"),
    ({"store": True}, "store"),
])
def test_rules_across_fields(fields, words):
    assert words in bad(ChatCompletionRequest, {"messages": USER, **fields}).message


def test_known_unsupported_fields_are_rejected_and_unknown_ones_ignored():
    error = bad(ChatCompletionRequest, {"messages": USER, "functions": [{"name": "f"}]})
    assert error.param == "functions" and "tools" in error.message
    assert bad(ChatCompletionRequest, []).message == "The request body must be a JSON object"
    request = chat_request(some_new_field=1, ignore_eos=True, top_k=-1)
    assert request.ignore_eos and request.top_k == -1


def test_defaults_and_aliases():
    request = chat_request(max_completion_tokens=5, stop="x", tools=[TOOL])
    assert request.requested_max_tokens == 5 and request.stops == ("x",)
    assert request.effective_tool_choice == "auto" and chat_request().effective_tool_choice == "none"
    assert parse(CompletionRequest, {"prompt": "a"}).max_tokens == 16
    assert parse(CompletionRequest, {"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert "best_of" in bad(CompletionRequest, {"prompt": "a", "n": 2, "best_of": 1}).message
    assert parse(EmbeddingRequest, {"input": "x"}).encoding_format == "float"
    bad(EmbeddingRequest, {"input": []})


def test_template_messages_render_tool_calls_and_results():
    request = chat_request(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], tools=[TOOL])
    messages = chat.template_messages(request, template_knows_tools=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[1]["content"] == "Weather\nin Paris?"
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>",
                           "tool_call_id": "call_1"}
    native = chat.template_messages(request, template_knows_tools=True)
    assert native[0]["content"] == "Be brief." and native[3]["role"] == "tool"


@pytest.mark.parametrize("arguments", ["not json", "[" * 2000])
def test_replayed_tool_call_arguments_that_do_not_decode_are_rendered_as_sent(arguments):
    # OpenAI accepts any string as `arguments` (a model's broken output, replayed); decoding it
    # raised (JSONDecodeError, or RecursionError when nested past the body's depth bound): a 500.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    request = chat_request(messages=[{"role": "assistant", "tool_calls": [call]}, *USER])
    content = chat.template_messages(request, template_knows_tools=False)[0]["content"]
    assert json.loads(content.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == \
        {"name": "f", "arguments": arguments}


def test_tool_choice_none_lists_no_tools():
    messages = chat.template_messages(chat_request(tools=[TOOL], tool_choice="none"), template_knows_tools=False)
    assert messages == [{"role": "user", "content": "hi"}]


def test_grammars_follow_response_format_and_tool_choice():
    assert chat.guided_decoding(chat_request()) is None
    assert json.loads(chat.guided_decoding(chat_request(response_format={"type": "json_object"})).json_schema) == \
        {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert json.loads(chat.guided_decoding(chat_request(response_format=fmt)).json_schema) == schema
    required = chat.guided_decoding(chat_request(tools=[TOOL, OTHER_TOOL], tool_choice="required")).lark
    assert required.startswith("start: calls\n") and "calls: call+" in required and "get_time" in required
    named = chat.guided_decoding(chat_request(tools=[TOOL, OTHER_TOOL], parallel_tool_calls=False,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert "get_weather" not in named.lark and "calls: call\n" in named.lark
    auto = chat.guided_decoding(chat_request(tools=[TOOL])).lark
    assert auto.startswith("start: calls | TEXT") and "TEXT: /[^<]" in auto
    auto_json = chat.guided_decoding(chat_request(tools=[TOOL], response_format={"type": "json_object"})).lark
    assert auto_json.startswith("start: calls | %json")
    assert chat.guided_decoding(chat_request(tools=[TOOL], tool_choice="none")).lark.startswith("start: TEXT")


def test_grammars_compile(smollm2_tokenizer):
    """Every grammar the chat layer writes is one llguidance accepts."""
    from lmi_serve.engine.sampling.grammar import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    for request in (chat_request(tools=[TOOL, OTHER_TOOL]), chat_request(tools=[TOOL], tool_choice="required"),
                    chat_request(tools=[TOOL], tool_choice="none"),
                    chat_request(tools=[TOOL], response_format={"type": "json_object"})):
        assert compiler.constraint(chat.guided_decoding(request)) is not None


def test_parse_tool_calls():
    one = chat.parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert one.content is None and one.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    two = chat.parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call> '
                                '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [c["function"]["name"] for c in two.tool_calls] == ["f", "g"]
    assert len({c["id"] for c in two.tool_calls}) == 2
    for text in ("Hello", '<tool_call>{"name": "f", "argu', "<b>bold</b>"):
        assert chat.parse_tool_calls(text).content == text and not chat.parse_tool_calls(text).tool_calls


def test_fit_to_context():
    assert fit_to_context(range(10), None, 100, where="prompt", param="prompt") == (tuple(range(10)), 90)
    assert fit_to_context(range(10), 5, 100, where="prompt", param="prompt")[1] == 5
    with pytest.raises(InvalidRequest) as caught:
        fit_to_context(range(10), 95, 100, where="messages", param="messages")
    assert caught.value.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens. However, you requested 105 tokens (10 in the messages, " \
           "95 in the completion)" in caught.value.message
    prompt, room = fit_to_context(range(10), 95, 100, where="prompt", param="prompt", truncate=True)
    assert prompt == (5, 6, 7, 8, 9) and room == 95
    with pytest.raises(InvalidRequest):
        fit_to_context(range(10), 100, 100, where="prompt", param="prompt", truncate=True)
    with pytest.raises(InvalidRequest):
        fit_to_context([], 1, 100, where="prompt", param="prompt")


def event(token_id, text, finish=None, top=()):
    return TokenEvent(token_id, text, -0.5, False, finish, top)


META = ResponseMeta("chatcmpl-1", 1, "m")
TEXT = {1: "Hi", 2: " there", 3: "<", 4: "tool_call>"}.get


def run_stream(events, *, tools=False, include_usage=False, logprobs=False):
    stream = ChatStream(META, include_usage=include_usage, logprobs=logprobs, top_logprobs=0, tools_enabled=tools,
                        token_text=lambda t: TEXT(t, "?"))
    state, chunks = ChoiceState(3, index=0), []
    for e in events:
        state.events.append(e)
        chunks += stream.on_event(state, e)
    return chunks, stream, state


def test_chat_stream_role_content_finish_and_usage():
    chunks, stream, state = run_stream([event(1, "Hi"), event(2, " there", FinishReason.EOS_TOKEN)],
                                       include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": " there"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["usage"] is None for c in chunks)
    assert stream.usage_chunk([state])["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_chat_stream_holds_a_tool_call_until_it_is_complete():
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    chunks, _, _ = run_stream([event(3, call[:5]), event(4, call[5:], FinishReason.EOS_TOKEN)], tools=True)
    assert [c["choices"][0]["delta"] for c in chunks][0] == {"role": "assistant", "content": ""}
    calls = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_stream_with_tools_streams_text_including_held_whitespace():
    chunks, _, _ = run_stream([event(5, " "), event(1, "Hi", FinishReason.LENGTH)], tools=True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == " Hi"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_body_with_logprobs():
    state = ChoiceState(4, [event(1, "Hi", top=(TopToken(1, "Hi", -0.5), TopToken(2, " there", -1.0))),
                               event(2, " there", FinishReason.STOP_SEQUENCE)], index=0)
    body = chat_completion(META, [state], logprobs=True, top_logprobs=1, tools_enabled=False,
                           token_text=lambda t: TEXT(t))
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi there"} and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"][0] == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}
    assert body["usage"]["total_tokens"] == 6


def test_completion_echo_suffix_and_offsets():
    prompt_tokens = (TopToken(9, "Say", None), TopToken(8, ":", -2.0))
    first = TokenEvent(1, "Hi", -0.5, False, None, (), prompt_tokens)
    state = ChoiceState(2, [first, event(2, " there", FinishReason.LENGTH)], index=0)
    choice = CompletionChoice(state, "Say:", echo=True, suffix="!")
    body = completion(ResponseMeta("cmpl-1", 1, "m"), [choice], logprobs=1, token_text=lambda t: TEXT(t),
                      prompt_tokens=2)
    out = body["choices"][0]
    assert out["text"] == "Say:Hi there!" and out["finish_reason"] == "length"
    assert out["logprobs"]["tokens"] == ["Say", ":", "Hi", " there"]
    assert out["logprobs"]["token_logprobs"][0] is None and out["logprobs"]["text_offset"] == [0, 3, 4, 6]
    chunk = completion_chunk(ResponseMeta("cmpl-1", 1, "m"), choice, state.events[-1], first=False, logprobs=None,
                             token_text=lambda t: TEXT(t), include_usage=False)
    assert chunk["choices"][0]["text"] == " there!" and chunk["choices"][0]["finish_reason"] == "length"


def completion_logprobs_of(events, logprobs, *, echo=False):
    choice = CompletionChoice(ChoiceState(2, list(events), index=0), "Say:", echo=echo, suffix=None)
    body = completion(ResponseMeta("cmpl-1", 1, "m"), [choice], logprobs=logprobs, token_text=lambda t: TEXT(t),
                      prompt_tokens=2)
    return body["choices"][0]["logprobs"]


def test_completion_top_logprobs_always_hold_the_chosen_token():
    greedy = [event(1, "Hi", top=(TopToken(1, "Hi", -0.5), TopToken(2, " there", -1.0))),
              event(2, " there", FinishReason.LENGTH, top=(TopToken(9, "Say", -0.1), TopToken(2, " there", -0.5)))]
    assert completion_logprobs_of(greedy, 0)["top_logprobs"] == [{"Hi": -0.5}, {" there": -0.5}]
    assert completion_logprobs_of(greedy, 1)["top_logprobs"] == [{"Hi": -0.5}, {"Say": -0.1, " there": -0.5}]
    # A sampled token outside the top-N gets its own entry: logprobs + 1 entries.
    sampled = [event(2, " there", FinishReason.LENGTH, top=(TopToken(9, "Say", -0.1), TopToken(1, "Hi", -0.2)))]
    assert completion_logprobs_of(sampled, 2)["top_logprobs"] == [{"Say": -0.1, "Hi": -0.2, " there": -0.5}]
    chunk = completion_chunk(ResponseMeta("cmpl-1", 1, "m"), CompletionChoice(ChoiceState(2, index=0), "", False, None),
                             sampled[0], first=True, logprobs=0, token_text=lambda t: TEXT(t), include_usage=False)
    assert chunk["choices"][0]["logprobs"]["top_logprobs"] == [{" there": -0.5}]


def test_echoed_prompt_top_logprobs_start_with_null():
    prompt_tokens = (TopToken(9, "Say", None), TopToken(8, ":", -2.0))
    first = TokenEvent(1, "Hi", -0.5, False, FinishReason.LENGTH, (), prompt_tokens)
    for logprobs in (0, 3):
        tops = completion_logprobs_of([first], logprobs, echo=True)["top_logprobs"]
        assert tops == [None, {":": -2.0}, {"Hi": -0.5}]


def test_chat_top_logprobs_are_exactly_the_alternatives_asked_for():
    sampled = event(2, " there", FinishReason.LENGTH, top=(TopToken(9, "Say", -0.1), TopToken(1, "Hi", -0.2)))
    for top, expected in ((0, []), (1, ["Say"]), (2, ["Say", "Hi"])):
        body = chat_completion(META, [ChoiceState(4, [sampled], index=0)], logprobs=True, top_logprobs=top,
                               tools_enabled=False, token_text=lambda t: TEXT(t))
        entry = body["choices"][0]["logprobs"]["content"][0]
        assert entry["token"] == " there" and [t["token"] for t in entry["top_logprobs"]] == expected


def test_embedding_inputs_as_text_or_token_id_lists():
    assert parse(EmbeddingRequest, {"input": "a"}).token_id_inputs is None
    assert parse(EmbeddingRequest, {"input": ["a", "b"]}).token_id_inputs is None
    assert parse(EmbeddingRequest, {"input": [101, -1, 2**64]}).token_id_inputs == [[101, -1, 2**64]]
    assert parse(EmbeddingRequest, {"input": [[101], [7, 8]]}).token_id_inputs == [[101], [7, 8]]
    assert bad(EmbeddingRequest, {"input": [[101], []]}).param == "input"
    assert bad(EmbeddingRequest, {"input": ["a", 1]}).param.startswith("input")


@pytest.mark.parametrize("model, field", [(CompletionRequest, "prompt"), (EmbeddingRequest, "input")])
@pytest.mark.parametrize("ids", [[True, 5], [[5, False]], [1.0, 5], [[5.0]]])
def test_token_ids_are_json_integers_not_coerced_booleans_or_floats(model, field, ids):
    assert bad(model, {field: ids}).param.startswith(field)


def test_stop_token_ids_are_json_integers():
    assert bad(CompletionRequest, {"prompt": "a", "stop_token_ids": [True]}).param.startswith("stop_token_ids")
