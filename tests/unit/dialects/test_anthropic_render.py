"""Anthropic's stream events (dialects/anthropic/render.py) from scripted engine events: their
order and shapes, parsed by the official `anthropic` client's own event types and added up by its
own accumulator, which must give exactly what `whole_message` gives; tool calls as tool_use blocks
with input_json deltas; stop reasons; a cut-short call's input."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from lmi_serve.dialects.anthropic.render import MessageMeta, MessageStream, stop_reason, tool_input, whole_message
from lmi_serve.dialects.openai.tool_formats import DEFAULT as HERMES
from lmi_serve.engine.types import FinishReason, TokenEvent

EVENTS = TypeAdapter(RawMessageStreamEvent)
META = MessageMeta("msg_1", "m", input_tokens=7)


def event(text: str, finish: FinishReason | None = None, stop: str | None = None) -> TokenEvent:
    return TokenEvent(1, text, -0.1, False, finish, stop_sequence=stop)


def run(pieces: list[tuple[str, str]], finish: FinishReason = FinishReason.EOS_TOKEN, *, stop: str | None = None,
        tools: bool = False, meta: MessageMeta = META, show_thinking: bool = True) -> list[dict]:
    """The events of a message whose engine events carry (reasoning, answer) `pieces`."""
    stream = MessageStream(meta, HERMES if tools else None, show_thinking=show_thinking)
    events = stream.start()
    for i, (thought, answer) in enumerate(pieces):
        last = i == len(pieces) - 1
        events += stream.feed(thought, event(answer, finish if last else None, stop if last else None))
    return events


def client_view(events: list[dict]) -> Message:
    """What the official client makes of the stream: every event parsed by its types, then added up
    (a `ping` it skips, by its SSE name, before parsing)."""
    snapshot, buffers = None, {}
    for raw in events:
        if raw["type"] == "ping":
            continue
        snapshot = accumulate_event(event=EVENTS.validate_python(raw), current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


def same(whole: dict, accumulated) -> bool:
    """Our whole message, as the client's Message type reads it, equals what the client accumulated."""
    return Message.model_validate(whole).model_dump(exclude_none=True) == accumulated.model_dump(exclude_none=True)


def test_text_streams_in_anthropics_order_and_adds_up_to_the_whole_message():
    events = run([("", "Hello"), ("", ", world"), ("", "")])
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert events[3]["delta"] == {"type": "text_delta", "text": "Hello"}
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"output_tokens": 3}}
    whole = whole_message(events)
    assert whole["content"] == [{"type": "text", "text": "Hello, world"}]
    assert same(whole, client_view(events))  # the client adds it up the same way


def test_thinking_then_text_blocks_and_the_client_agrees():
    events = run([("Two and ", ""), ("two.", ""), ("", "Four"), ("", ".")])
    whole = whole_message(events)
    assert whole["content"] == [{"type": "thinking", "thinking": "Two and two.", "signature": ""},
                                {"type": "text", "text": "Four."}]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "text_delta", "text_delta"]
    assert same(whole, client_view(events))


def test_omitted_thinking_keeps_the_block_without_its_text():
    whole = whole_message(run([("secret", ""), ("", "Four")], show_thinking=False))
    assert whole["content"] == [{"type": "thinking", "thinking": "", "signature": ""},
                                {"type": "text", "text": "Four"}]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def split(text: str, size: int = 5) -> list[tuple[str, str]]:
    return [("", text[i:i + size]) for i in range(0, len(text), size)]


def test_a_tool_call_is_a_tool_use_block_whose_input_streams_as_json():
    events = run(split(CALL), tools=True)
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    assert start["content_block"]["id"].startswith("toolu_") and start["content_block"]["input"] == {}
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    whole = whole_message(events)
    assert whole["content"] == [{**start["content_block"], "input": {"city": "Paris"}}]
    assert same(whole, client_view(events))


def test_two_calls_are_two_blocks():
    events = run(split(CALL + "\n" + CALL.replace("Paris", "Rome")), tools=True)
    blocks = whole_message(events)["content"]
    assert [(b["type"], b["input"]) for b in blocks] == [("tool_use", {"city": "Paris"}),
                                                         ("tool_use", {"city": "Rome"})]
    assert len({b["id"] for b in blocks}) == 2
    assert same(whole_message(events), client_view(events))


def test_with_tools_text_that_is_no_call_is_held_until_it_shows_then_sent_whole():
    events = run([("", " "), ("", "\n"), ("", "Sunny"), ("", " today")], tools=True)
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [{"type": "text_delta", "text": " \nSunny"}, {"type": "text_delta", "text": " today"}]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_a_call_cut_short_ends_for_max_tokens_with_the_input_so_far():
    cut = CALL[:CALL.index("Paris") + 3]  # ... {"city": "Par
    events = run(split(cut.replace('"Par', '"Paris", "days": 3, "unit": "ce')), FinishReason.LENGTH, tools=True)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    whole = whole_message(events)
    assert whole["content"][0]["input"] == {"city": "Paris", "days": 3}  # the unfinished string left out
    assert same(whole, client_view(events))  # as the client reads a partial input


def test_a_stop_sequence_is_named_and_a_full_context_says_so():
    events = run([("", "Count: 1, 2")], FinishReason.STOP_SEQUENCE, stop=", 3")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": ", 3"}
    capped = MessageMeta("msg_2", "m", 7, capped=True)
    assert run([("", "x")], FinishReason.LENGTH, meta=capped)[-2]["delta"]["stop_reason"] == \
        "model_context_window_exceeded"
    assert run([("", "x")], FinishReason.LENGTH)[-2]["delta"]["stop_reason"] == "max_tokens"


def test_stop_reason_prefers_complete_calls():
    assert stop_reason(event("", FinishReason.EOS_TOKEN), True, False) == ("tool_use", None)
    assert stop_reason(event("", FinishReason.EOS_TOKEN), False, False) == ("end_turn", None)


@pytest.mark.parametrize(("text", "expected"), [
    ('{"a": 1, "b": [1, 2]}', {"a": 1, "b": [1, 2]}),
    ('{"a": "x\\"y", "b": {"c": tr', {"a": 'x"y', "b": {}}),
    ('{"a": [1, 2', {"a": [1, 2]}),
    ('{"a": "x", ', {"a": "x"}),
    ('{"a": "he', {}),
    ("", {}),
])
def test_tool_input_reads_a_cut_short_object_as_the_client_does(text, expected):
    from jiter import from_json

    assert tool_input(text) == expected
    if text:
        assert from_json(text.encode(), partial_mode=True) == expected  # the official client's reader
