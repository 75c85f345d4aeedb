"""POST /v1/responses through the official `openai` client (strict validation: every body and event
must fit openai.types.responses) against the package's shared server (conftest.py):
- SmolLM2 (`llama-json`, greedy) for text, a JSON-schema answer, a two-turn tool call, chained and
  replayed turns, stored responses (GET, DELETE, 404s);
- the tiny reasoner (`tiny`, seeded; a token budget closes its block) for `reasoning` items.
Streams are read with `client.responses.stream` and must agree with the whole response."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from pydantic import BaseModel

from tiny_store import REASONER, TOOL_PARSER as MODEL

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "strict": True, "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                    "enum": ["Paris", "Rome"]}},
                                          "required": ["city"], "additionalProperties": False}}


class City(BaseModel):
    city: str


CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server)


def streamed(client, **body):
    """(the stream's final Response, its events) through the client's own stream helper."""
    with client.responses.stream(**body) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def test_text_whole_and_streamed_agree(client):
    whole = client.responses.create(input=QUESTION, instructions="Answer in a few words.", **GREEDY)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert [item.type for item in whole.output] == ["message"]
    usage = whole.usage
    assert 1 <= usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    final, events = streamed(client, input=QUESTION, instructions="Answer in a few words.", **GREEDY)
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_json_schema_answer_whole_and_streamed(client):
    whole = client.responses.create(input="Which city is the capital of France?", text=CITY_FORMAT,
                                    **{**GREEDY, "max_output_tokens": 20})
    assert json.loads(whole.output_text)["city"] in ("Paris", "Rome", "Madrid")
    with client.responses.stream(input="Which city is the capital of France?", text_format=City,
                                 **{**GREEDY, "max_output_tokens": 20}) as stream:
        final = stream.get_final_response()
    assert final.output_parsed.city == json.loads(whole.output_text)["city"]


def test_two_turn_tool_call_chained_or_replayed_answers_alike(client):
    first = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    **{**GREEDY, "max_output_tokens": 30})
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    city = json.loads(calls[0].arguments)["city"]
    assert city in ("Paris", "Rome") and calls[0].call_id
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": f"Sunny, 21 C in {city}"}
    second = {"tools": [WEATHER], "tool_choice": "none", **{**GREEDY, "max_output_tokens": 12}}
    chained = client.responses.create(previous_response_id=first.id, input=[result], **second)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output], result]
    replayed = client.responses.create(input=history, **second)
    assert chained.output_text and chained.output_text == replayed.output_text  # the same conversation
    assert chained.previous_response_id == first.id
    final, events = streamed(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                             **{**GREEDY, "max_output_tokens": 30})
    streamed_call = next(item for item in final.output if item.type == "function_call")
    assert streamed_call.arguments == calls[0].arguments
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    assert final.output[0].parsed_arguments == {"city": city}  # the client parsed it against the strict tool


def test_stored_responses_are_retrieved_deleted_and_then_404(client):
    answer = client.responses.create(input=QUESTION, metadata={"case": "store"}, **{**GREEDY, "max_output_tokens": 2})
    kept = client.responses.retrieve(answer.id)
    assert kept.model_dump() == answer.model_dump() and kept.metadata == {"case": "store"}
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(answer.id)
    assert answer.id in gone.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(previous_response_id=answer.id, input="And Spain?", **GREEDY)
    assert answer.id in missing.value.message and missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input=QUESTION, store=False, **{**GREEDY, "max_output_tokens": 2})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


REASONING = {"model": REASONER, "input": "What is 2+2?", "max_output_tokens": 24, "text": CITY_FORMAT,
             "extra_body": {"seed": 0}}


def test_reasoning_items_whole_and_streamed(client):
    whole = client.responses.create(**REASONING)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    thought = reasoning.content[0].text
    assert thought and "think>" not in thought and json.loads(whole.output_text)["city"]
    assert 1 <= whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    final, events = streamed(client, **REASONING)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert final.output[0].content[0].text == thought and final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens


@pytest.mark.parametrize("body, param, words", [
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type",
     "computer_call_output"),
    ({"input": "Hi", "background": True}, "background", "background"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort", "does not reason"),
    ({"input": "Hi", "previous_response_id": "resp_nowhere"}, "previous_response_id", "resp_nowhere"),
])
def test_what_cannot_be_honoured_is_refused_in_openai_shape(server, body, param, words):
    response = requests.post(server.url("/v1/responses"), json={"model": MODEL, **body}, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and set(error) == {"message", "type", "param", "code"}
