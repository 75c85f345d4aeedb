"""OpenAI chat completions against the real server and model, through the official `openai` client
with strict response validation (every body and chunk must fit the client's types)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests
from openai import OpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                              "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                             "required": ["tz"]}}}


@pytest.fixture(scope="module")
def client(default_server, openai_client) -> OpenAI:
    return openai_client(default_server)


def chat(client, messages=CAPITAL, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_answers_the_capital_of_france_and_counts_the_templated_prompt(client, tokenizer):
    response = chat(client, max_tokens=20)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-") and response.model == MODEL
    templated = tokenizer.apply_chat_template(CAPITAL, tokenize=False, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False).input_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_max_tokens_and_max_completion_tokens_bound_the_output(client):
    for limit in ({"max_tokens": 4}, {"max_completion_tokens": 4}):
        response = chat(client, messages=[{"role": "user", "content": "Tell me a long story."}], **limit)
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 4


def test_stream_agrees_with_the_whole_response(client):
    whole = chat(client, max_tokens=8)
    chunks = list(chat(client, max_tokens=8, stream=True))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices[0].delta.content is None  # the finish chunk has an empty delta
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_stream_include_usage_ends_with_a_usage_chunk(client):
    chunks = list(chat(client, messages=[{"role": "user", "content": "Count to twenty."}], max_tokens=8,
                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format(default_server):
    response = requests.post(default_server.url("/v1/chat/completions"), stream=True, timeout=60,
                             json={"model": MODEL, "messages": CAPITAL, "max_tokens": 3, "stream": True})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in response.iter_lines() if line]
    assert all(line.startswith(b"data: ") for line in events)
    assert events[-1] == b"data: [DONE]"


def test_stop_strings_end_the_answer_without_the_stop_text(client):
    whole = chat(client, max_tokens=20).choices[0].message.content
    assert "." in whole
    for stop in (".", ["."], [" Paris", "."]):
        choice = chat(client, max_tokens=20, stop=stop).choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content == whole[:min(whole.find(s) for s in ([stop] if isinstance(stop, str) else stop)
                                                    if s in whole)]


def test_n_choices_sampled_with_a_seed(client):
    response = chat(client, n=2, temperature=0.8, seed=1, max_tokens=10, logprobs=True)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)
    again = chat(client, n=2, temperature=0.8, seed=1, max_tokens=10)
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]
    chunks = list(chat(client, n=2, temperature=0.8, seed=1, max_tokens=10, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert sum(1 for c in mine if c.finish_reason) == 1
        assert "".join(c.delta.content or "" for c in mine) == response.choices[index].message.content


def test_seeded_sampling_repeats_and_greedy_options_are_accepted(client):
    first = chat(client, temperature=1.0, seed=1234, max_tokens=12).choices[0].message.content
    assert chat(client, temperature=1.0, seed=1234, max_tokens=12).choices[0].message.content == first
    assert chat(client, temperature=0, top_p=1.0).choices[0].finish_reason in ("stop", "length")


def test_logprobs_in_the_chat_shape(client):
    response = chat(client, logprobs=True, top_logprobs=3, max_tokens=6)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the best
    plain = chat(client, logprobs=True, max_tokens=3).choices[0].logprobs.content
    assert plain and all(entry.top_logprobs == [] for entry in plain)
    streamed = [c for c in chat(client, logprobs=True, top_logprobs=2, max_tokens=6, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == [e.token for e in content]


def test_logit_bias_bans_a_token(client, tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    content = chat(client, logit_bias={str(paris[0]): -100}, max_tokens=20).choices[0].message.content
    assert " Paris" not in content


def test_unknown_fields_are_ignored_and_vllm_extensions_honoured(client):
    response = chat(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                    extra_body={"some_future_field": {"x": 1}, "ignore_eos": True})
    assert response.usage.completion_tokens == 20 and response.choices[0].finish_reason == "length"


def test_text_parts_and_system_and_developer_roles(client):
    parts = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    assert chat(client, messages=parts, max_tokens=10).choices[0].message.content


def test_json_object_output_parses(client):
    response = chat(client, messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
                    response_format={"type": "json_object"}, max_tokens=60)
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


class Capital(BaseModel):
    country: str
    capital: str


def test_json_schema_output_validates_with_parse(client):
    response = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format=Capital, temperature=0, max_tokens=60)
    parsed = response.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital


def test_json_schema_constraints_hold(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "tags"],
              "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                             "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}}}
    for seed in range(3):
        response = chat(client, messages=[{"role": "user", "content": "Is Paris in France?"}], temperature=1.0,
                        seed=seed, max_tokens=80,
                        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema,
                                                                                "strict": True}})
        value = json.loads(response.choices[0].message.content)
        assert set(value) == {"answer", "confidence", "tags"} and value["answer"] in ("yes", "no")
        assert 0 <= value["confidence"] <= 100 and len(value["tags"]) <= 2


def check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def test_forced_tool_calls_have_valid_arguments(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        response = chat(client, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,
                        max_tokens=60)
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls" and message.content is None
        if choice == "required":
            assert message.tool_calls[0].function.name in ("get_weather", "get_time")
        else:
            assert check_weather_call(message.tool_calls[0])["city"]


def test_streamed_tool_call_accumulates_in_the_client_helper(client):
    with client.chat.completions.stream(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                        max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    check_weather_call(final.choices[0].message.tool_calls[0])


def test_tool_round_trip(client):
    first = chat(client, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = WEATHER_QUESTION + [
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is sunny and 22 degrees celsius in Paris."},
    ]
    answer = chat(client, messages=conversation, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=40)
    assert answer.choices[0].message.tool_calls is None
    assert "22" in answer.choices[0].message.content
    alone = chat(client, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens  # the call and its result were rendered


def test_auto_tool_choice_may_answer_in_text(client):
    response = chat(client, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER_TOOL],
                    tool_choice="auto", max_tokens=20)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "stop"


def test_concurrent_greedy_chats_equal_sequential_ones(default_server, client, openai_client):
    questions = ["What is the capital of France?", "Name a color.", "What is 2 + 2?", "Say hi.",
                 "Name a fruit.", "What is the largest ocean?", "Who wrote Hamlet?", "Name a planet."]
    sequential = [chat(client, messages=[{"role": "user", "content": q}], max_tokens=12).choices[0].message.content
                  for q in questions]
    aclient = openai_client(default_server, asynchronous=True)

    async def all_at_once():
        calls = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                 max_tokens=12, temperature=0) for q in questions]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(all_at_once()) == sequential


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2, "temperature": 0}, None),
    ({"logprobs": False, "top_logprobs": 2}, None),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stream_options": {"include_usage": True}}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"extra_body": {"reasoning_effort": "low"}}, "reasoning_effort"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"extra_body": {"top_k": 2**63}}, "top_k"),
    ({"extra_body": {"stop_token_ids": [49152]}}, "stop_token_ids"),
])
def test_validation_errors_are_400_in_openai_shape(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **kwargs)
    assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"
    if param:
        assert caught.value.param.startswith(param)


def test_context_overflow_uses_openai_wording(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=10**6)
    assert "maximum context length is 8192 tokens" in caught.value.message
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def test_bad_messages_and_schemas_are_400(client):
    cases = [[], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
             [{"role": "tool", "content": "x"}], [{"role": "wizard", "content": "x"}]]
    for messages in cases:
        with pytest.raises(openai.BadRequestError):
            chat(client, messages=messages)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, response_format={"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}})
    assert "schema" in caught.value.message


def test_unknown_model_route_and_malformed_json(client, default_server):
    # One text-generation model is served: an unknown name selects it, as TGI does, and the answer names it
    answer = client.chat.completions.create(model="no-such-model", messages=CAPITAL, max_tokens=2)
    assert answer.model == MODEL
    for path, data in (("/v1/chat/completions", b"{not json"), ("/v1/nope", b"{}")):
        response = requests.post(default_server.url(path), data=data, timeout=30)
        assert response.status_code == (400 if path.endswith("completions") else 404)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    nested = b"[" * 1000 + b"]" * 1000
    surrogate = rb'{"input": "\ud800", "prompt": "\ud800", "messages": [{"role": "user", "content": "\ud800"}]}'
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        for data in (nested, surrogate):  # were 500s: RecursionError, and the tokenizer's TypeError
            response = requests.post(default_server.url(path), data=data, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    wrong_task = requests.post(default_server.url("/v1/chat/completions"), timeout=30,
                               json={"model": "all-minilm-l6-v2", "messages": CAPITAL})
    assert wrong_task.status_code == 400


def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert models[0].id == MODEL and {m.id for m in models} >= {MODEL, "all-minilm-l6-v2"}
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_on_invocations_uses_lmi_chat_schema(default_server, client):
    body = {"messages": CAPITAL, "max_tokens": 10, "temperature": 0}
    whole = requests.post(default_server.url("/invocations"), json=body, timeout=60).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == chat(client, max_tokens=10).choices[0].message.content
    lines = requests.post(default_server.url("/invocations"), json={**body, "stream": True}, timeout=60)
    assert lines.headers["Content-Type"].startswith("application/jsonlines")
    chunks = [json.loads(line) for line in lines.iter_lines() if line]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    sse = requests.post(default_server.url("/invocations"), json={**body, "stream": True}, timeout=60,
                        headers={"Accept": "text/event-stream"})
    assert sse.headers["Content-Type"].startswith("text/event-stream")
    assert sse.text.rstrip().endswith("data: [DONE]")
    bad = requests.post(default_server.url("/invocations"), json={"messages": [], "max_tokens": 3}, timeout=30)
    assert bad.status_code == 424 and "messages" in bad.json()["error"]


def test_continuous_usage_stats_counts_as_it_goes(client):
    chunks = list(chat(client, max_tokens=5, stream=True, messages=[{"role": "user", "content": "Count to ten."}],
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert counts and counts == sorted(set(counts))  # strictly rising with each content chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    # As in vLLM, running usage needs include_usage too.
    alone = list(chat(client, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}))
    assert alone and all(c.usage is None for c in alone)
