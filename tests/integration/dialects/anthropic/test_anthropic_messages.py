"""Anthropic's Messages API over HTTP with the official `anthropic` client, unchanged (strict response
validation: every body and every stream event must parse as its own types), on the shared tiny store
(integration/conftest.py): text whole and streamed, stop sequences, count_tokens, `thinking` on the
reasoner, a tool round trip (tool_use, then tool_result), images (base64 and url) on a tiny VLM,
errors in Anthropic's shape, and a client leaving mid-stream. Greedy where a stream must equal a whole answer (`temperature`
travels in extra_body: this client version no longer names it); the tiny models' random weights
make the texts meaningless, and the tests check only what the server does with them."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import pytest
import requests

import tiny_vlm
from server_process import wait_for
from tiny_store import REASONER, TOOL_PARSER

pytestmark = pytest.mark.integration

GREEDY = {"extra_body": {"temperature": 0}}
COUNT = [{"role": "user", "content": "Count to ten."}]
ADD = {"name": "add", "description": "Add a number", "input_schema": {
    "type": "object", "properties": {"x": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["x"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # the shared tiny store (integration/conftest.py): the reasoner, smolvlm, llama-json


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url(""), api_key="x", max_retries=0, timeout=300,
                               _strict_response_validation=True)


def blocks(message) -> list[tuple]:
    """A message's content, comparable whatever class the client built (whole or accumulated)."""
    return [block.model_dump(include={"type", "text", "thinking", "name", "input"}) for block in message.content]


def test_text_whole_and_streamed_agree_and_every_event_parses(client):
    whole = client.messages.create(model=REASONER, max_tokens=8, messages=COUNT, **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0
    with client.messages.stream(model=REASONER, max_tokens=8, messages=COUNT, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole) and text == whole.content[-1].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)
    raw = [event.type for event in client.messages.create(model=REASONER, max_tokens=8, messages=COUNT, stream=True,
                                                            **GREEDY)]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) <= {"content_block_delta", "content_block_start", "content_block_stop"}


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    text = client.messages.create(model=REASONER, max_tokens=8, messages=COUNT, **GREEDY).content[-1].text
    # greedy: the same text comes again, up to the stop sequence, first seen after the answer's first character
    stop = next(text[i:i + 3] for i in range(1, len(text)) if text.index(text[i:i + 3]) == i and text[i:i + 3].strip())
    stopped = client.messages.create(model=REASONER, max_tokens=8, messages=COUNT, stop_sequences=["zzz", stop],
                                     **GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[-1].text == text[:text.index(stop)] and stopped.usage.output_tokens < 8


def test_count_tokens_counts_what_a_message_reads(client):
    request = {"model": REASONER, "system": "Be brief.", "messages": COUNT, "tools": [ADD]}
    counted = client.messages.count_tokens(**request).input_tokens
    used = client.messages.create(max_tokens=2, **request, **GREEDY).usage.input_tokens
    assert counted == used and counted > client.messages.count_tokens(model=REASONER, messages=COUNT).input_tokens


JSON_ANSWER = {"format": {"type": "json_schema", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer", "enum": [3, 4, 5]}}, "required": ["answer"],
    "additionalProperties": False}}}


def test_thinking_on_the_reasoner_comes_as_thinking_blocks(client):
    # Sampled: the random weights' greedy thinking is whitespace, which no block carries.
    request = {"model": REASONER, "max_tokens": 30, "messages": [{"role": "user", "content": "What is 2+2?"}],
               "thinking": {"type": "enabled", "budget_tokens": 2}, "output_config": JSON_ANSWER}
    whole = client.messages.create(**request)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and "think>" not in whole.content[0].thinking
    assert json.loads(whole.content[1].text)["answer"] in (3, 4, 5) and whole.stop_reason == "end_turn"
    with client.messages.stream(**request) as stream:
        kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta", "text_delta"}
    assert [block.type for block in final.content] == ["thinking", "text"] and final.stop_reason == "end_turn"
    assert json.loads(final.content[1].text)["answer"] in (3, 4, 5)


def test_thinking_where_the_model_cannot_think_is_a_400_naming_it(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=TOOL_PARSER, max_tokens=30, messages=COUNT,
                               thinking={"type": "enabled", "budget_tokens": 3})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("thinking: the model `llama-json` does not think")


def test_a_tool_round_trip(client):
    # On smolvlm (ChatML, no tool support in its template: calls are written into the turns): the
    # reasoner's DeepSeek-R1 template reads a past call's arguments as a string, which the chat
    # service hands templates decoded, so a round trip there is refused on /v1/chat/completions too.
    request = {"model": "smolvlm", "max_tokens": 60, "tools": [ADD], **GREEDY,
               "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    question = [{"role": "user", "content": "Add a number."}]
    whole = client.messages.create(messages=question, **request)
    use = whole.content[-1]
    assert whole.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
    assert use.input["x"] in (1, 2, 3) and use.id.startswith("toolu_")
    with client.messages.stream(messages=question, **request) as stream:
        fragments = [event.delta.partial_json for event in stream
                     if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input
    assert json.loads("".join(fragments)) == use.input
    turn = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]}]

    def answered(result: str) -> list[dict]:
        return [*turn, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]

    reply = client.messages.create(messages=answered("3"), **{**request, "max_tokens": 6,
                                                               "tool_choice": {"type": "none"}})
    assert reply.content[-1].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    longer = client.messages.count_tokens(model="smolvlm", tools=[ADD], messages=answered("3 " * 20))
    assert longer.input_tokens >= reply.usage.input_tokens + 20  # the result is in the prompt


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_vlm.image(seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_server():
    """A loopback HTTP server with png(1) at /cat.png (smolvlm fetches any URL: option.image_fetch=any)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = png(1)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def test_images_base64_and_url_answer_as_openai_chat_does(server, client, image_server):
    import openai

    def ask(source: dict):
        return client.messages.create(model="smolvlm", max_tokens=6, **GREEDY, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "What is in the picture?"}]}])

    data = base64.b64encode(png(1)).decode()
    message = ask({"type": "base64", "media_type": "image/png", "data": data})
    chat = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0).chat.completions.create(
        model="smolvlm", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "What is in the picture?"}]}])
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens  # the image's tokens, as the processor expands them
    fetched = ask({"type": "url", "url": f"{image_server}/cat.png"})
    assert blocks(fetched) == blocks(message) and fetched.usage.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:  # a text model
        client.messages.create(model=REASONER, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}])
    assert caught.value.body["error"]["message"].startswith("messages.0.content.0: the model `tiny` takes text only")


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": COUNT}, "max_tokens: Field required"),
    ({"max_tokens": 5, "messages": COUNT, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ({"max_tokens": 5, "messages": [*COUNT, {"role": "assistant", "content": "One,"}]}, "prefill"),
    ({"max_tokens": 5, "messages": COUNT, "top_k": -1}, "top_k"),
    ({"max_tokens": 5, "messages": COUNT, "seed": 1}, "seed: Extra inputs are not permitted"),
])
def test_bad_requests_are_400s_in_anthropics_shape(server, body, words):
    response = requests.post(server.url("/v1/messages"), json={"model": REASONER, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert words in response.json()["error"]["message"]


def test_an_unknown_model_is_a_404_listing_the_served_ones(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=COUNT)
    assert caught.value.body["error"]["type"] == "not_found_error" and "`tiny`" in caught.value.body["error"]["message"]


def engine_stats(server) -> dict:
    return requests.get(server.url(f"/models/{REASONER}"), timeout=30).json()[0]["models"][0]["engine"]


def test_a_client_leaving_mid_stream_frees_the_engine(server):
    wait_for(lambda: engine_stats(server)["running"] == 0, timeout=120)
    steps = engine_stats(server)["steps"]
    # greedy: the tiny reasoner repeats itself, never ending with EOS before it is cancelled
    body = {"model": REASONER, "max_tokens": 3000, "messages": COUNT, "stream": True, "temperature": 0}
    with requests.post(server.url("/v1/messages"), stream=True, timeout=60, json=body) as response:
        lines = response.iter_lines()
        assert next(lines) == b"event: message_start"
        wait_for(lambda: engine_stats(server)["running"] == 1, timeout=60)
    wait_for(lambda: engine_stats(server)["running"] == 0, timeout=60)  # no longer generating
    assert engine_stats(server)["steps"] - steps < 3000  # dropped, not finished


def test_the_routes_are_counted_as_the_anthropic_dialect(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def answered() -> float:
        text = requests.get(server.url("/metrics"), timeout=30).text
        labels = {"dialect": "anthropic", "route": "/v1/messages/count_tokens", "model_name": REASONER}
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "lmi_serve:http_requests_total" and labels.items() <= sample.labels.items())

    before = answered()
    client.messages.count_tokens(model=REASONER, messages=COUNT)
    assert answered() == before + 1
