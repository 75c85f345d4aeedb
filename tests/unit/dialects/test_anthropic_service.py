"""The Messages service on a scripted engine (SmolLM2's tokenizer; no model runs): what reaches the
engine, whole = stream, stop sequences, max_tokens capped at the context, the checks made before
anything is queued, failures before and after the stream starts, and a closed stream cancelling."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from lmi_serve.dialects.anthropic.convert import chat_request
from lmi_serve.dialects.anthropic.render import whole_message
from lmi_serve.dialects.anthropic.schema import CountTokensRequest, MessagesRequest, parse
from lmi_serve.dialects.anthropic.service import MessagesService
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import InvalidRequest, Overloaded

VOCAB = 49152
TEXT = [TokenEvent(1, "One", -0.5, False), TokenEvent(2, ", two", -0.5, False),
        TokenEvent(3, "", -0.5, False, FinishReason.STOP_SEQUENCE, stop_sequence=", three")]
BASE = {"model": "claude-x", "max_tokens": 20, "messages": [{"role": "user", "content": "Count."}],
        "stop_sequences": [", three", "four"]}


class ScriptedEngine:
    """Answers every request with `output` (a failure raised at submission with `refusal`)."""

    def __init__(self, tokenizer, output=TEXT, max_model_len=512, refusal=None):
        self.tokenizer, self.max_model_len, self.eos_token_ids = tokenizer, max_model_len, frozenset({0})
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB))
        self.vocab_size = VOCAB
        self.output, self.refusal = output, refusal
        self.submitted, self.handles = [], []

    def generate(self, requests):
        if self.refusal is not None:
            raise self.refusal
        self.submitted += requests
        sink = queue.SimpleQueue()
        self.handles = [RequestHandle(request, None, sink=sink, index=i) for i, request in enumerate(requests)]
        for event in self.output:
            self.handles[0].push(event)
        return Generation(self.handles, sink)


def service(engine) -> MessagesService:
    return MessagesService(OpenAIService(engine, "smol"))


def create(engine, **fields):
    return service(engine).create(parse(MessagesRequest, {**BASE, **fields}))


def without_ids(message: dict) -> dict:
    return {**message, "id": None}


def test_the_engine_gets_the_requests_settings_and_the_answer_names_its_stop_sequence(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer)
    body = create(engine, temperature=0.5, top_k=3).body
    (request,) = engine.submitted
    assert request.stop.stop_sequences == (", three", "four") and request.stop.max_new_tokens == 20
    assert (request.sampling.temperature, request.sampling.top_k) == (0.5, 3)
    assert body["content"] == [{"type": "text", "text": "One, two"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", ", three")
    assert body["usage"] == {"input_tokens": len(request.prompt_ids), "output_tokens": 3}
    assert body["model"] == "smol" and body["id"].startswith("msg_") and body["role"] == "assistant"


def test_a_stream_adds_up_to_the_whole_message(smollm2_tokenizer):
    whole = create(ScriptedEngine(smollm2_tokenizer)).body
    events = list(create(ScriptedEngine(smollm2_tokenizer), stream=True).events)
    assert events[0]["type"] == "message_start" and events[-1] == {"type": "message_stop"}
    assert without_ids(whole_message(events)) == without_ids(whole)


def test_max_tokens_beyond_the_context_is_capped_and_a_full_context_says_so(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer, output=[TokenEvent(1, "One", -0.5, False, FinishReason.LENGTH)])
    prompt = len(service(engine).chat.chat_prompt(chat_request(parse(MessagesRequest, BASE)))[1])
    engine.max_model_len = prompt + 5
    body = create(engine, max_tokens=1000).body
    assert engine.submitted[0].stop.max_new_tokens == 5  # what the context leaves, not a 400
    assert body["stop_reason"] == "model_context_window_exceeded"
    fitting = ScriptedEngine(smollm2_tokenizer, output=engine.output, max_model_len=prompt + 5)
    assert create(fitting, max_tokens=5).body["stop_reason"] == "max_tokens"


def test_count_tokens_counts_the_prompt_the_message_would_read(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer)
    counted = service(engine).count_tokens(parse(CountTokensRequest, {"model": "m", "messages": BASE["messages"]}))
    create(engine)
    assert counted == {"input_tokens": len(engine.submitted[0].prompt_ids)}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 5}}, "thinking", "does not think"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]}]},
     "messages.0.content.0", "takes text only"),
])
def test_what_the_model_cannot_do_is_refused_before_anything_is_queued(smollm2_tokenizer, fields, param, words):
    engine = ScriptedEngine(smollm2_tokenizer)
    with pytest.raises(InvalidRequest) as caught:
        create(engine, **fields)
    assert caught.value.param == param and words in caught.value.message
    with pytest.raises(InvalidRequest):
        service(engine).count_tokens(parse(CountTokensRequest, {"model": "m", "messages": BASE["messages"], **{
            k: v for k, v in fields.items() if k != "max_tokens"}}))
    assert not engine.submitted


def test_thinking_disabled_or_adaptive_is_fine_on_a_model_that_does_not_think(smollm2_tokenizer):
    for thinking in ({"type": "disabled"}, {"type": "adaptive"}):
        assert create(ScriptedEngine(smollm2_tokenizer), thinking=thinking).body["content"]


def test_a_failure_after_the_stream_started_is_its_last_event_an_anthropic_error(smollm2_tokenizer):
    output = [TEXT[0], TokenEvent.failure("RuntimeError: injected fault")]
    events = list(create(ScriptedEngine(smollm2_tokenizer, output=output), stream=True).events)
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "RuntimeError: injected fault"}}
    assert any(e.get("delta", {}).get("text") == "One" for e in events)  # what came before went out


def test_failures_before_the_first_token_raise_their_kind(smollm2_tokenizer):
    full = Overloaded("the waiting queue is full")
    with pytest.raises(Overloaded):
        create(ScriptedEngine(smollm2_tokenizer, refusal=full), stream=True)
    timeout = TokenEvent.failure("waited too long", kind=Overloaded)
    with pytest.raises(Overloaded):
        create(ScriptedEngine(smollm2_tokenizer, output=[timeout]), stream=True)


def test_closing_a_stream_cancels_its_generation(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer, output=TEXT[:2])  # still running
    events = create(engine, stream=True).events
    next(events)
    assert not engine.handles[0].cancelled
    events.close()  # what the WSGI server does when the client goes away
    assert engine.handles[0].cancelled


def test_a_client_gone_while_nothing_is_written_stops_the_stream_at_the_next_step(smollm2_tokenizer, monkeypatch):
    from lmi_serve.dialects.anthropic import service as service_module

    class LeavesAfterTheFirstStep:
        checks = 0

        def closed(self):
            self.checks += 1
            return self.checks > 1

    monkeypatch.setattr(service_module.ClientConnection, "current", classmethod(lambda cls: LeavesAfterTheFirstStep()))
    engine = ScriptedEngine(smollm2_tokenizer, output=TEXT[:2])  # more to come: generation still running
    events = list(create(engine, stream=True).events)  # ends by itself: no write had to fail
    assert [e["type"] for e in events][-1] == "content_block_delta"  # the first step's text, then nothing
    assert engine.handles[0].cancelled


def test_a_schema_the_grammar_compiler_refuses_names_the_anthropic_field(smollm2_tokenizer):
    from lmi_serve.engine.sampling.grammar import GrammarError

    engine = ScriptedEngine(smollm2_tokenizer, refusal=GrammarError("unsupported keyword"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with pytest.raises(InvalidRequest) as caught:
        create(engine, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert caught.value.param == "output_config.format" and "unsupported keyword" in caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        create(engine, tools=[{"name": "f", "input_schema": schema}])
    assert caught.value.message.startswith("tools: invalid or unsupported schema")
