"""A Responses request's parsing and its translation to a chat request, without a model: what is
honoured becomes the chat fields that honour it, what is not is a 400 naming the field (or item)."""

from __future__ import annotations

import json

import pytest

from lmi_serve.dialects.openai.responses import convert, items
from lmi_serve.dialects.openai.responses.request import ResponsesRequest
from lmi_serve.dialects.openai.schema import NamedToolChoice, parse
from lmi_serve.errors import ContextOverflow, InvalidRequest

TOOL = {"type": "function", "name": "add", "description": "Add", "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


def chat(body: dict, history: list[dict] | None = None, template: str = "", reasoner: bool = False):
    request = parse(ResponsesRequest, body)
    conversation = items.conversation(request.instructions, history or [], items.as_items(request.input))
    return convert.chat_request(request, conversation, template, reasoner)


def refusal(body: dict, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        chat(body, **kw)
    return caught.value


def roles(request) -> list[str]:
    return [m.role for m in request.messages]


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    request = chat({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.2,
                    "top_p": 0.5, "stream": True})
    assert roles(request) == ["system", "user"] and request.messages[0].text == "Be brief."
    assert request.messages[1].text == "Hi"
    assert (request.max_completion_tokens, request.temperature, request.top_p) == (7, 0.2, 0.5)
    assert request.stream and request.include_usage  # the stream's last event carries the usage


def test_items_become_the_chat_conversation_of_a_tool_round_trip():
    request = chat({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add 1"},
                                                          {"type": "input_text", "text": " please"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call add."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": "{\"x\": 1}",
         "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{\"x\": 2}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "1 and 2.", "annotations": [], "logprobs": []}]},
    ], "tools": [TOOL]})
    assert roles(request) == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert request.messages[0].text == "Use tools." and request.messages[1].text == "Add 1 please"
    calls = request.messages[2].tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "add", "{\"x\": 1}"), ("call_2", "add", "{\"x\": 2}")]  # one turn, both calls
    assert request.messages[2].model_extra["reasoning_content"] == "Call add."
    assert [(m.tool_call_id, m.text) for m in request.messages[3:5]] == [("call_1", "1"), ("call_2", "2")]
    assert request.messages[5].text == "1 and 2."


def test_history_of_a_previous_response_comes_first_without_its_instructions():
    history = [{"type": "message", "role": "user", "content": "Hi"},
               {"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}]
    request = chat({"input": "And you?", "instructions": "Now in French."}, history=history)
    assert roles(request) == ["system", "user", "assistant", "user"]
    assert [m.text for m in request.messages] == ["Now in French.", "Hi", "Hello!", "And you?"]


def test_an_image_part_is_an_image_url_part_of_the_user_message():
    url = "data:image/png;base64,iVBORw0KGgo="
    request = chat({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": url, "detail": "auto"}]}]})
    assert request.messages[0].image_urls == [(1, url)] and request.messages[0].text == "What is this?"


def test_tools_tool_choice_and_text_format_become_the_chat_fields():
    request = chat({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "add"},
                    "parallel_tool_calls": False})
    assert request.tools[0].function.name == "add" and request.tools[0].function.parameters == TOOL["parameters"]
    assert isinstance(request.tool_choice, NamedToolChoice) and request.tool_choice.function == {"name": "add"}
    assert request.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = chat({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}})
    assert fmt.response_format.type == "json_schema" and fmt.response_format.json_schema.schema_ == schema
    assert chat({"input": "Hi", "text": {"format": {"type": "json_object"}}}).response_format.type == "json_object"
    assert chat({"input": "Hi", "tools": [], "tool_choice": "auto"}).tools is None  # an agent with no tools


@pytest.mark.parametrize("template, effort, kwargs", [
    ("{% if enable_thinking %}", "none", {"enable_thinking": False}),
    ("{% if enable_thinking %}", "high", {"enable_thinking": True}),
    ("Reasoning: {{ reasoning_effort }}", "minimal", {"reasoning_effort": "low"}),
    ("Reasoning: {{ reasoning_effort }}", "medium", {"reasoning_effort": "medium"}),
])
def test_reasoning_effort_sets_the_templates_switch(template, effort, kwargs):
    request = chat({"input": "Hi", "reasoning": {"effort": effort, "summary": "auto"}}, template=template,
                   reasoner=True)
    assert request.chat_template_kwargs == kwargs


def test_reasoning_effort_a_model_cannot_honour_is_refused():
    assert chat({"input": "Hi", "reasoning": {"effort": "none"}}).chat_template_kwargs is None  # nothing to turn off
    for reasoner in (False, True):
        error = refusal({"input": "Hi", "reasoning": {"effort": "high"}}, reasoner=reasoner)
        assert error.param == "reasoning.effort" and "'high'" in error.message


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [TOOL, {"type": "web_search_preview"}]}, "tools.1.type", "web_search_preview"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice.type", "file_search"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "sub"}}, None, "'sub'"),
    ({"background": True}, "background", "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"conversation": "conv_1"}, "conversation", "Conversations"),
    ({"service_tier": "priority"}, "service_tier", "tiers"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "'low'"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning", "summaries"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format", "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
])
def test_fields_that_cannot_be_honoured_are_400_naming_them(body, param, words):
    error = refusal({"input": "Hi", **body})
    assert error.param == param and words in error.message


@pytest.mark.parametrize("item, param, words", [
    ({"type": "web_search_call", "id": "ws_1"}, "input.1.type", "web_search_call"),
    ({"type": "item_reference", "id": "msg_1"}, "input.1.type", "item_reference"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.1.content.0", "input_file"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "f", "detail": "auto"}]},
     "input.1.content.0.file_id", "image_url"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "high"}]},
     "input.1.content.0.detail", "'high'"),
    ({"type": "function_call", "call_id": "c", "name": "add"}, "input.1.arguments", "required"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, "input.1.encrypted_content", "encrypted"),
    ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]}, "input.1", "reasoning item"),
    ({"role": "tool", "content": "x"}, "input.1.role", "Input should be"),
    ("text", "input.1", "object"),
])
def test_items_that_cannot_be_honoured_are_400_naming_the_item(item, param, words):
    error = refusal({"input": [{"role": "user", "content": "Hi"}, item]})
    assert error.param == param and words in error.message


def test_nothing_to_answer_is_a_400_naming_input():
    assert refusal({"input": []}).param == "input"


def test_chat_errors_name_the_responses_fields():
    conversation = items.conversation("Be brief.", [], [{"role": "user", "content": "Hi"}])
    for raised, param, message in (
            (ContextOverflow("messages: 9000 tokens do not fit", param="messages"), "input",
             "input: 9000 tokens do not fit"),
            (InvalidRequest("messages[1].content[0]: no images here", param="messages[1].content[0]"),
             "input.0.content.0", "input.0.content.0: no images here"),
            (InvalidRequest("messages[0]: bad", param="messages[0]"), "instructions", "instructions: bad"),
            (InvalidRequest("response_format.json_schema.schema: invalid", param="response_format"), "text.format",
             "text.format: invalid"),
            (InvalidRequest("max_completion_tokens must be ...", param="max_completion_tokens"), "max_output_tokens",
             "max_output_tokens must be ...")):
        with pytest.raises(type(raised)) as caught, convert.responses_names(conversation):
            raise raised
        assert (caught.value.param, caught.value.message) == (param, message)
        assert caught.value.code == raised.code  # the same error, only worded in the request's names


def test_unknown_fields_are_ignored_and_neutral_refused_values_accepted():
    request = parse(ResponsesRequest, {"input": "Hi", "background": False, "include": [], "truncation": "disabled",
                                       "service_tier": "auto", "store": True, "new_field": 1, "top_logprobs": 0})
    assert request.model_extra == {"new_field": 1} and request.stores
    assert json.loads(request.model_dump_json())["input"] == "Hi"
