"""option.tool_call_parser through the real server: SmolLM2's template implies no family (Hermes
would be used); the option makes it Llama 3's JSON, and the official `openai` client (strict
validation) reads the calls, whole and streamed, on /v1 and on the LMI route's chat schema."""

from __future__ import annotations

import json

import pytest
import requests

from tiny_store import TOOL_PARSER as MODEL

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # the shared tiny store (integration/conftest.py), where MODEL has the option


def test_calls_are_written_and_read_in_the_named_format(server, openai_client):
    client = openai_client(server)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, **FORCED)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, **FORCED) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_the_lmi_route_chat_uses_the_option_too(server):
    body = {"messages": QUESTION, **FORCED}
    response = requests.post(server.url(f"/predictions/{MODEL}"), json=body, timeout=300)
    assert response.status_code == 200, response.text
    call = response.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
