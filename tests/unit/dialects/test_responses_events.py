"""The Responses service on a scripted engine (SmolLM2's tokenizer, no model): whole Responses and
their event streams, which must agree; a stream closed early cancels the generation; stored
responses continue a conversation and are served by GET / DELETE."""

from __future__ import annotations

import json
import queue

import pytest
from flask import Flask
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from lmi_serve.dialects.common import streaming
from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.dialects.openai.responses import routes
from lmi_serve.dialects.openai.responses.request import ResponsesRequest
from lmi_serve.dialects.openai.responses.service import ResponsesService
from lmi_serve.dialects.openai.responses.store import ResponseStore, Stored
from lmi_serve.dialects.openai.schema import parse
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import InvalidRequest, NotFound

TEXT = ["Hello", " there", ""]  # the last: EOS, no text
CALL = ["<tool_call>", '\n{"name": "add", ', '"arguments": {"x": ', "1}}", "\n</tool_call>", ""]
THINKING = ["<think>", "Two", " and two.", "</think>", "Four", ""]
TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
EVENT = TypeAdapter(ResponseStreamEvent)


class ScriptedEngine:
    """Answers every request with `pieces` (one token each; the last ends it for `reason`, or never
    when `reason` is None); remembers the requests and generations."""

    def __init__(self, tokenizer, pieces, reason=FinishReason.EOS_TOKEN, failure=None):
        self.tokenizer, self.max_model_len, self.eos_token_ids, self.vocab_size = tokenizer, 512, frozenset({5}), 49152
        self.pieces, self.reason, self.failure = pieces, reason, failure
        self.submitted, self.generations = [], []

    def generate(self, requests):
        self.submitted += requests
        sink = queue.SimpleQueue()
        handle = RequestHandle(requests[0], None, sink=sink, index=0)
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1 and self.failure is None
            handle.push(TokenEvent(10 + i, text, -0.5, False, self.reason if last else None))
        if self.failure is not None:
            handle.push(self.failure)
        self.generations.append(Generation([handle], sink))
        return self.generations[-1]


def service(tokenizer, pieces, store=None, reasoning=None, **engine):
    store = store if store is not None else ResponseStore(4)
    chat = OpenAIService(ScriptedEngine(tokenizer, pieces, **engine), "m", reasoning=reasoning)
    return ResponsesService(chat, store, lambda: [store])


def whole_and_streamed(tokenizer, pieces, body, **kw):
    whole = service(tokenizer, pieces, **kw).create(parse(ResponsesRequest, body))
    events = list(service(tokenizer, pieces, **kw).create(parse(ResponsesRequest, {**body, "stream": True})))
    for event in events:
        EVENT.validate_python(event)  # the openai package's own event types
    OpenAIResponse.model_validate(whole)
    return whole, events


def without_ids(value):
    """A Response with its ids and times left out: what a stream and a whole response must share."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id", "created_at", "completed_at")}
    return [without_ids(v) for v in value] if isinstance(value, list) else value


def kinds(events):
    return [e["type"] for e in events]


def test_a_text_answer_streams_the_message_events_and_agrees(smollm2_tokenizer):
    whole, events = whole_and_streamed(smollm2_tokenizer, TEXT, {"input": "Hi", "instructions": "Be brief."})
    assert kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta",
                             "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert without_ids(final) == without_ids(whole) and whole["status"] == "completed"
    assert whole["output"][0]["content"][0]["text"] == "Hello there" == events[6]["text"]
    item_id = events[2]["item"]["id"]
    named = {e.get("item_id", e.get("item", {}).get("id")) for e in events[2:9]}
    assert named == {item_id} == {final["output"][0]["id"]}  # one item, the same id from added to completed
    assert whole["usage"]["output_tokens"] == 3 and whole["instructions"] == "Be brief."


def test_a_tool_call_streams_its_arguments_and_agrees(smollm2_tokenizer):
    whole, events = whole_and_streamed(smollm2_tokenizer, CALL, {"input": "Add 1", "tools": [TOOL],
                                                                 "tool_choice": "required"})
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    call = whole["output"][0]
    assert (call["name"], call["arguments"], call["status"]) == ("add", '{"x": 1}', "completed")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert "response.output_text.delta" not in kinds(events)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(deltas) == done["arguments"] == call["arguments"] and len(deltas) > 1
    assert without_ids(events[-1]["response"]) == without_ids(whole)
    assert events[2]["item"]["arguments"] == "" and events[2]["item"]["name"] == "add"


def test_reasoning_comes_as_a_reasoning_item_before_the_message(smollm2_tokenizer):
    whole, events = whole_and_streamed(smollm2_tokenizer, THINKING, {"input": "2+2?"},
                                       reasoning=ReasoningSettings("deepseek_r1"))
    reasoning, message = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two and two."}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "Four"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 4  # the markers count, as in chat
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Two and two." and without_ids(events[-1]["response"]) == without_ids(whole)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]


def test_the_token_limit_makes_the_response_incomplete_in_both(smollm2_tokenizer):
    whole, events = whole_and_streamed(smollm2_tokenizer, ["Hel", "lo"], {"input": "Hi", "max_output_tokens": 2},
                                       reason=FinishReason.LENGTH)
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][-1]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete" and without_ids(events[-1]["response"]) == without_ids(whole)


def test_an_empty_answer_is_an_empty_message_in_both(smollm2_tokenizer):
    whole, events = whole_and_streamed(smollm2_tokenizer, [""], {"input": "Hi"})
    assert whole["output"][0]["content"][0]["text"] == "" and without_ids(events[-1]["response"]) == without_ids(whole)


def test_a_failure_after_the_stream_began_is_an_error_event_then_failed(smollm2_tokenizer):
    store = ResponseStore(4)
    responses = service(smollm2_tokenizer, ["One"], store=store, failure=TokenEvent.failure("RuntimeError: boom"))
    events = list(responses.create(parse(ResponsesRequest, {"input": "Hi", "stream": True})))
    for event in events:
        EVENT.validate_python(event)
    assert kinds(events)[-2:] == ["error", "response.failed"]
    assert "boom" in events[-2]["message"] and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error" and len(store) == 0  # a failure is not kept


def test_closing_the_stream_cancels_the_generation(smollm2_tokenizer):
    responses = service(smollm2_tokenizer, ["a", "b", "c"], reason=None)  # never finishes by itself
    frames = streaming.sse_named(responses.create(parse(ResponsesRequest, {"input": "Hi", "stream": True})))
    first = [next(frames) for _ in range(5)]  # up to the first delta: the client then goes away
    assert first[0].startswith("event: response.created\ndata: ") and "response.output_text.delta" in first[4]
    handle = responses.chat.engine.generations[0].handles[0]
    assert not handle.cancelled
    frames.close()
    assert handle.cancelled  # the engine drops the row at its next step


def test_previous_response_id_continues_the_stored_conversation(smollm2_tokenizer):
    store = ResponseStore(4)
    first = service(smollm2_tokenizer, TEXT, store=store).create(parse(ResponsesRequest, {"input": "Say hello"}))
    assert store.get(first["id"]).response == first
    follow = service(smollm2_tokenizer, ["Bye", ""], store=store)
    second = follow.create(parse(ResponsesRequest, {"input": "Now bye", "previous_response_id": first["id"]}))
    prompt = smollm2_tokenizer.decode(follow.chat.engine.submitted[0].prompt_ids)
    assert prompt.index("Say hello") < prompt.index("Hello there") < prompt.index("Now bye")
    assert second["previous_response_id"] == first["id"]
    assert store.get(second["id"]).history[-1] == second["output"][0]
    with pytest.raises(NotFound) as gone:
        follow.create(parse(ResponsesRequest, {"input": "x", "previous_response_id": "resp_elsewhere"}))
    assert gone.value.param == "previous_response_id" and "resp_elsewhere" in gone.value.message


def test_the_store_is_bounded_and_store_false_keeps_nothing(smollm2_tokenizer):
    store = ResponseStore(2)
    ids = [service(smollm2_tokenizer, TEXT, store=store).create(parse(ResponsesRequest, {"input": "Hi"}))["id"]
           for _ in range(3)]
    assert store.get(ids[0]) is None and store.get(ids[1]) and store.get(ids[2])  # the oldest dropped
    unstored = service(smollm2_tokenizer, TEXT, store=store).create(parse(ResponsesRequest,
                                                                          {"input": "Hi", "store": False}))
    assert store.get(unstored["id"]) is None
    with pytest.raises(InvalidRequest) as refused:
        service(smollm2_tokenizer, TEXT, store=ResponseStore(0)).create(
            parse(ResponsesRequest, {"input": "Hi", "store": True}))
    assert refused.value.param == "store"


@pytest.fixture
def app_client():
    app = Flask(__name__)
    app.register_blueprint(routes.blueprint)
    return app, app.test_client()


def test_get_and_delete_a_stored_response(app_client):
    app, client = app_client
    stored = Stored({"id": "resp_1", "object": "response", "output": []}, [])
    store = ResponseStore(2)
    store.put(stored)
    with app.app_context():
        routes._stores()["m"] = store
    assert client.get("/v1/responses/resp_1").get_json() == stored.response
    refused = client.get("/v1/responses/resp_1?stream=true")
    assert refused.status_code == 400 and refused.get_json()["error"]["param"] == "stream"
    deleted = client.delete("/v1/responses/resp_1")
    assert deleted.get_json() == {"id": "resp_1", "object": "response.deleted", "deleted": True}
    for gone in (client.get("/v1/responses/resp_1"), client.delete("/v1/responses/resp_1")):
        error = gone.get_json()["error"]
        assert gone.status_code == 404 and "resp_1" in error["message"] and error["code"] == "response_not_found"


@pytest.mark.parametrize("body, param", [
    (b"[]", None), (b'{"input": "Hi", "temperature": NaN}', None),
    (json.dumps({"input": "Hi", "tools": [{"type": "code_interpreter"}]}).encode(), "tools.0.type"),
])
def test_bad_bodies_are_openai_400s_before_any_model_is_looked_up(app_client, body, param):
    response = app_client[1].post("/v1/responses", data=body, content_type="application/json")
    error = response.get_json()["error"]
    assert response.status_code == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
