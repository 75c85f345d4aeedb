"""Anthropic Messages bodies: validation (every refusal a 400 naming the field) and their mapping
onto the neutral chat request (dialects/anthropic/schema.py, convert.py)."""

from __future__ import annotations

import pytest

from lmi_serve.dialects.anthropic.convert import chat_request
from lmi_serve.dialects.anthropic.schema import CountTokensRequest, MessagesRequest, parse
from lmi_serve.dialects.openai.schema import NamedToolChoice
from lmi_serve.errors import InvalidRequest

BASE = {"model": "claude-x", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                                      {"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                 {"type": "text", "text": "And tomorrow?"}]},
]


def convert(**fields):
    return chat_request(parse(MessagesRequest, {**BASE, **fields}))


def test_a_tool_round_trip_becomes_the_chat_conversation():
    chat = convert(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use metric."}],
                   messages=ROUND_TRIP, tools=[WEATHER], tool_choice={"type": "auto"}, stop_sequences=["\n\n"],
                   temperature=0.2, top_p=0.9, top_k=5)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nUse metric."
    assistant = chat.messages[2]
    assert assistant.text == "Let me look." and assistant.model_extra["reasoning_content"] == "Use the tool."
    call = assistant.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_1", "get_weather", '{"city": "Paris"}')
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("toolu_1", "Sunny")
    assert chat.messages[4].text == "And tomorrow?"
    tool = chat.tools[0].function
    assert (tool.name, tool.description, tool.parameters) == ("get_weather", "The weather", WEATHER["input_schema"])
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls
    assert (chat.stops, chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (("\n\n",), 0.2, 0.9, 5, 50)


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "tool", "name": "get_weather"}, NamedToolChoice(type="function", function={"name": "get_weather"}),
     True),
])
def test_tool_choice_maps_onto_the_chats(choice, expected, parallel):
    chat = convert(tools=[WEATHER], tool_choice=choice)
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


def test_an_error_result_says_so_and_consecutive_turns_are_one():
    chat = convert(messages=[{"role": "user", "content": "A"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": True, "content": [{"type": "text", "text": "boom"}]}]},
        {"role": "user", "content": "B"}])
    assert [(m.role, m.text) for m in chat.messages] == [("user", "A"), ("tool", "Error: boom"), ("user", "B")]


def test_images_become_image_parts():
    chat = convert(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "text", "text": "Same?"}]}])
    assert chat.messages[0].image_urls == [(0, "data:image/png;base64,iVBOR"), (1, "https://example.com/a.png")]


@pytest.mark.parametrize(("thinking", "kwargs", "budget"), [
    ({"type": "enabled", "budget_tokens": 20}, {"enable_thinking": True}, 20),
    ({"type": "disabled"}, {"enable_thinking": False}, None),
    ({"type": "adaptive"}, None, None),
])
def test_thinking_sets_the_templates_switch_and_the_budget(thinking, kwargs, budget):
    chat = convert(thinking=thinking)
    assert chat.chat_template_kwargs == kwargs and chat.thinking_token_budget == budget


def test_a_json_output_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = convert(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema


def test_count_tokens_takes_no_max_tokens():
    request = parse(CountTokensRequest, {"model": "m", "messages": BASE["messages"], "system": "S"})
    chat = chat_request(request)
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.max_tokens is None
    with pytest.raises(InvalidRequest, match="max_tokens: Extra inputs"):
        parse(CountTokensRequest, BASE)


def refusal(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        chat_request(parse(MessagesRequest, body))
    return caught.value


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"max_tokens": None}, "max_tokens", "Field required"),  # left out: required, as Anthropic has it
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"unknown": 1}, "unknown", "Extra inputs are not permitted"),
    ({"container": "c"}, "container", "not supported"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers", "MCP"),
    ({"output_config": {"effort": "high"}}, "output_config.effort", "effort cannot be set"),
    ({"speed": "fast"}, "speed", "one speed"),
    ({"thinking": {"type": "enabled", "budget_tokens": 50}}, None, "less than max_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking", "budget_tokens is required"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "server tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema", "type 'object'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, None, "not in tools"),
    ({"tool_choice": {"type": "any"}}, None, "needs tools"),
    ({"stop_sequences": [""]}, "stop_sequences", "must not be empty"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0",
     "'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages.0.content.0.source", "Files API"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/bmp", "data": "x"}}]}]}, "messages.0.content.0.source.media_type",
     "image/png"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0", "assistant messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.0.content.0.content", "tool result holds text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
     "messages.0.content.0.citations", "citations"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
     "messages.1", "prefill"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(change, param, words):
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    error = refusal(body)
    assert error.param == param and words in error.message, error.message
    if param:
        assert error.message.startswith(param)


def test_what_changes_nothing_here_is_accepted():
    chat = convert(metadata={"user_id": "u1"}, service_tier="standard_only", cache_control={"type": "ephemeral"},
                   speed="standard", messages=[{"role": "user", "content": [
                       {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
                   tools=[{**WEATHER, "cache_control": {"type": "ephemeral"}, "strict": True,
                           "eager_input_streaming": True}])
    assert chat.messages[0].text == "Hi" and chat.tools[0].function.name == "get_weather"
