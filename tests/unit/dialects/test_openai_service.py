"""OpenAIService on a scripted engine: stream usage accounting and the checks made against the
model (vocabulary) before anything is queued. The tokenizer is SmolLM2's; no model runs."""

from __future__ import annotations

import json
import queue
from types import SimpleNamespace

import pytest

from lmi_serve.dialects.openai.errors import status
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, CompletionRequest, parse
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.sampling.grammar import GrammarError
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import GenerationFailed, InvalidRequest, Overloaded

VOCAB = 49152
OUTPUT = [(1, "One"), (2, ","), (3, " two"), (4, "."), (5, "")]  # the last: EOS, no text
USER = [{"role": "user", "content": "Count."}]



class ScriptedEngine:
    """Answers every request with OUTPUT; remembers what was submitted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len, self.eos_token_ids = tokenizer, 512, frozenset({5})
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB))
        self.vocab_size = VOCAB  # Engine.vocab_size, what the dialect reads
        self.submitted = []

    def generate(self, requests):
        """Every sequence's events already queued, one sequence after the other."""
        self.submitted += requests
        last = len(OUTPUT) - 1
        sink = queue.SimpleQueue()
        handles = [RequestHandle(request, None, sink=sink, index=index) for index, request in enumerate(requests)]
        for handle in handles:
            for i, (t, text) in enumerate(OUTPUT):
                handle.push(TokenEvent(t, text, -0.5, False, FinishReason.EOS_TOKEN if i == last else None))
        return Generation(handles, sink)


@pytest.fixture
def engine(smollm2_tokenizer):
    return ScriptedEngine(smollm2_tokenizer)


def stream_chunks(engine, model, body) -> list[dict]:
    service = OpenAIService(engine, "m")
    if model is ChatCompletionRequest:
        reply = service.chat(parse(model, {"messages": USER, "stream": True, **body}))
    else:
        reply = service.completions(parse(model, {"prompt": "Count:", "stream": True, **body}))
    return list(reply.chunks)


CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_continuous_usage_rises_with_each_content_chunk(engine, model):
    chunks = stream_chunks(engine, model, {"n": 2, **CONTINUOUS})
    assert all(c["usage"] is not None for c in chunks)
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        role = [c for c in mine if c["choices"][0].get("delta", {}).get("role")]
        content = [c for c in mine if c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text")]
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert len(content) == 4 and counts == sorted(set(counts))  # strictly rising
        if role:  # chat: the role chunk goes out before its choice's first token is counted
            assert role[0]["usage"]["completion_tokens"] == counts[0] - 1
    assert chunks[0]["usage"]["completion_tokens"] == (0 if model is ChatCompletionRequest else 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * len(OUTPUT)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_continuous_usage_stats_needs_include_usage(engine, model):
    chunks = stream_chunks(engine, model, {"stream_options": {"continuous_usage_stats": True}})
    assert chunks and all("usage" not in c for c in chunks)


def test_token_ids_outside_the_vocabulary_are_400_naming_field_and_id(engine):
    service = OpenAIService(engine, "m")
    for body, param, token in (({"prompt": [[5, VOCAB]]}, "prompt", VOCAB),
                               ({"prompt": "Hi", "stop_token_ids": [7, VOCAB + 3]}, "stop_token_ids", VOCAB + 3)):
        with pytest.raises(InvalidRequest) as caught:
            service.completions(parse(CompletionRequest, body))
        assert status(caught.value) == 400 and caught.value.param == param and str(token) in caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        service.chat(parse(ChatCompletionRequest, {"messages": USER, "stop_token_ids": [VOCAB]}))
    assert caught.value.param == "stop_token_ids"
    assert not engine.submitted


def test_in_range_seeds_reach_the_engine_as_valid_seeds(engine):
    service = OpenAIService(engine, "m")
    for seed in (-2**63, -1, 2**63 - 1):
        service.completions(parse(CompletionRequest, {"prompt": "Hi", "seed": seed, "n": 2}))
    seeds = [r.sampling.seed for r in engine.submitted]
    assert all(0 <= s < 2**63 for s in seeds) and seeds[0] + 1 == seeds[1]


def test_use_raw_prompt_false_with_token_ids_is_400_not_ignored(engine):
    with pytest.raises(InvalidRequest) as caught:
        OpenAIService(engine, "m").completions(parse(CompletionRequest, {"prompt": [5, 6], "use_raw_prompt": False}))
    assert status(caught.value) == 400 and caught.value.param == "use_raw_prompt"
    assert not engine.submitted


class FailingEngine(ScriptedEngine):
    """One token, then `failure`; or `refusal` raised at submission."""

    def __init__(self, tokenizer, failure=None, refusal=None):
        super().__init__(tokenizer)
        self.failure, self.refusal = failure, refusal

    def generate(self, requests):
        if self.refusal is not None:
            raise self.refusal
        self.submitted += requests
        sink = queue.SimpleQueue()
        handles = [RequestHandle(request, None, sink=sink, index=index) for index, request in enumerate(requests)]
        for handle in handles:
            handle.push(TokenEvent(1, "One", -0.5, False, None))
            handle.push(self.failure)
        return Generation(handles, sink)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_a_failure_after_the_stream_started_is_its_last_chunk_an_openai_error(smollm2_tokenizer, model):
    engine = FailingEngine(smollm2_tokenizer, failure=TokenEvent.failure("RuntimeError: injected fault"))
    service = OpenAIService(engine, "m")
    body = {"stream": True, **({"messages": USER} if model is ChatCompletionRequest else {"prompt": "Count:"})}
    serve = service.chat if model is ChatCompletionRequest else service.completions
    reply = serve(parse(model, body))
    events = list(reply.sse())
    assert events[-1] == "data: [DONE]\n\n"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last == {"error": {"message": "Generation failed: RuntimeError: injected fault", "type": "server_error",
                              "param": None, "code": None}}
    assert any("One" in event for event in events[:-2])  # the token before the failure went out


def test_a_failure_after_tokens_fails_a_whole_response_as_generation_failed(smollm2_tokenizer):
    engine = FailingEngine(smollm2_tokenizer, failure=TokenEvent.failure("RuntimeError: injected fault"))
    with pytest.raises(GenerationFailed) as caught:
        OpenAIService(engine, "m").completions(parse(CompletionRequest, {"prompt": "Count:"}))
    assert caught.value.message == "Generation failed: RuntimeError: injected fault" and status(caught.value) == 500


def test_the_engines_refusals_pass_through_as_kinds(smollm2_tokenizer):
    full = Overloaded("Model is overloaded: the waiting queue is full")
    with pytest.raises(Overloaded) as caught:
        OpenAIService(FailingEngine(smollm2_tokenizer, refusal=full), "m").chat(
            parse(ChatCompletionRequest, {"messages": USER}))
    assert caught.value is full and status(caught.value) == 429
    bad_grammar = FailingEngine(smollm2_tokenizer, refusal=GrammarError("unsupported keyword"))
    with pytest.raises(InvalidRequest) as caught:
        OpenAIService(bad_grammar, "m").chat(parse(ChatCompletionRequest, {"messages": USER}))
    assert caught.value.message == "response_format: invalid or unsupported schema, pattern or grammar: unsupported keyword"
    assert caught.value.param == "response_format" and status(caught.value) == 400
