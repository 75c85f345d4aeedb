"""Chat completions of a reasoning model (openai/reasoning.py) on a scripted engine with Qwen3's real
chat template: `reasoning_content` beside the answer, streamed = whole, include_reasoning, usage,
tool calls parsed from the answer alone, and the options that switch it off or bound it."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from lmi_serve.dialects.openai.reasoning import ReasoningSettings
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.dialects.openai.service import OpenAIService
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.types import FinishReason, TokenEvent
from lmi_serve.errors import InvalidRequest
from server_process import FIXTURES

USER = [{"role": "user", "content": "What is 2+2?"}]
# The pieces a detokenizer may release: markers split across pieces, whitespace after them.
THOUGHT = ["<think>", "\nTwo", " and two", "</th", "ink>", "\n\n"]
ANSWER = ["It", " is", " 4."]
CALL = ['<tool_call>{"name": "add", ', '"arguments": {"x": 2}}', "</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]


class ScriptedEngine:
    """Answers every request with `pieces` (one token each, then EOS); remembers what was submitted."""

    def __init__(self, tokenizer, pieces):
        self.tokenizer, self.max_model_len, self.eos_token_ids = tokenizer, 512, frozenset({0})
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=len(tokenizer)))
        self.vocab_size = len(tokenizer)  # Engine.vocab_size, what the dialect reads
        self.pieces, self.submitted = pieces, []

    def generate(self, requests):
        self.submitted += requests
        sink = queue.SimpleQueue()
        handles = [RequestHandle(request, None, sink=sink, index=i) for i, request in enumerate(requests)]
        for handle in handles:
            for i, text in enumerate(self.pieces):
                handle.push(TokenEvent(100 + i, text, -0.5, False))
            handle.push(TokenEvent(0, "", -0.1, True, FinishReason.EOS_TOKEN))
        return Generation(handles, sink)


@pytest.fixture(scope="module")
def qwen3(smollm2_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (FIXTURES / "chat_templates" / "qwen3.jinja").read_text()
    return tokenizer


def _chat(tokenizer, pieces, body, settings=None):
    engine = ScriptedEngine(tokenizer, pieces)
    reply = OpenAIService(engine, "m", reasoning=settings).chat(parse(ChatCompletionRequest, {"messages": USER, **body}))
    return engine, reply


def _whole_and_streamed(tokenizer, pieces, body, settings=None):
    _, whole = _chat(tokenizer, pieces, body, settings)
    _, streamed = _chat(tokenizer, pieces, {**body, "stream": True, "stream_options": {"include_usage": True}},
                        settings)
    return whole.body, list(streamed.chunks)


def _deltas(chunks, key):
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("n", [1, 2])
def test_reasoning_and_answer_whole_and_streamed_alike(qwen3, n):
    body, chunks = _whole_and_streamed(qwen3, THOUGHT + ANSWER, {"n": n})
    for choice in body["choices"]:
        assert choice["message"]["reasoning_content"] == "Two and two"
        assert choice["message"]["content"] == "It is 4." and choice["finish_reason"] == "stop"
    mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == 0]
    assert _deltas(mine, "reasoning_content") == "Two and two" and _deltas(mine, "content") == "It is 4."
    assert not any("think>" in (v or "") for c in chunks for ch in c["choices"] for v in ch["delta"].values()
                   if isinstance(v, str))
    # reasoning deltas all come before the first content delta
    kinds = [k for c in mine for k in ("reasoning_content", "content") if c["choices"][0]["delta"].get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    details = {"reasoning_tokens": 5 * n}  # <think>, \nTwo, " and two", </th, ink>
    assert body["usage"]["completion_tokens_details"] == details
    assert chunks[-1]["usage"]["completion_tokens_details"] == details
    assert body["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"] == n * (len(THOUGHT) + 4)


def test_include_reasoning_false_leaves_it_out_but_counts_it(qwen3):
    body, chunks = _whole_and_streamed(qwen3, THOUGHT + ANSWER, {"include_reasoning": False})
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "It is 4."
    assert _deltas(chunks, "reasoning_content") == "" and _deltas(chunks, "content") == "It is 4."
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_thinking_off_in_the_template_makes_it_all_answer(qwen3):
    pieces = ["<think>", "x</think>", "4"]  # whatever the model writes: the prompt closed the block
    body, chunks = _whole_and_streamed(qwen3, pieces, {"chat_template_kwargs": {"enable_thinking": False}})
    assert body["choices"][0]["message"]["content"] == "<think>x</think>4" == _deltas(chunks, "content")
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_an_answer_without_a_block_is_all_content(qwen3):
    body, chunks = _whole_and_streamed(qwen3, ANSWER, {})
    assert body["choices"][0]["message"]["content"] == "It is 4." == _deltas(chunks, "content")
    assert body["choices"][0]["message"]["reasoning_content"] is None


def test_an_unclosed_block_cut_by_max_tokens_is_all_reasoning(qwen3):
    body, chunks = _whole_and_streamed(qwen3, THOUGHT[:3], {})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two" == _deltas(chunks, "reasoning_content")
    assert message["content"] == "" == _deltas(chunks, "content")


def test_tool_calls_are_parsed_from_the_answer_alone(qwen3):
    body, chunks = _whole_and_streamed(qwen3, THOUGHT + CALL, {"tools": TOOLS})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Two and two"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"x": 2}'}
    calls = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert [c["function"] for c in calls] == [choice["message"]["tool_calls"][0]["function"]]
    assert _deltas(chunks, "reasoning_content") == "Two and two" and _deltas(chunks, "content") == ""


def test_the_grammar_sent_to_the_engine_starts_after_the_block(qwen3):
    engine, _ = _chat(qwen3, ANSWER, {"response_format": {"type": "json_object"}, "thinking_token_budget": 8})
    lark = engine.submitted[0].guided.lark
    assert lark.startswith("start: (<think> reason </think>") and "%json" in lark and "max_tokens=8" in lark


def test_reasoning_parser_none_leaves_the_output_whole(qwen3):
    body, _ = _whole_and_streamed(qwen3, THOUGHT + ANSWER, {}, ReasoningSettings(parser="none"))
    message = body["choices"][0]["message"]
    assert message["content"] == "".join(THOUGHT + ANSWER) and "reasoning_content" not in message
    assert "completion_tokens_details" not in body["usage"]


def test_the_server_budget_applies_and_a_request_may_lower_it(qwen3):
    settings = ReasoningSettings(max_tokens=16)
    engine, _ = _chat(qwen3, ANSWER, {}, settings)
    assert "max_tokens=16" in engine.submitted[0].guided.lark
    engine, _ = _chat(qwen3, ANSWER, {"thinking_token_budget": 4}, settings)
    assert "max_tokens=4" in engine.submitted[0].guided.lark


def test_a_budget_on_plain_text_markers_is_a_400_naming_the_field(smollm2_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_model_dir))  # no <think> tokens
    with pytest.raises(InvalidRequest) as caught:
        _chat(tokenizer, ANSWER, {"thinking_token_budget": 4}, ReasoningSettings(parser="qwen3"))
    assert caught.value.param == "thinking_token_budget"
    with pytest.raises(InvalidRequest) as caught:
        parse(ChatCompletionRequest, {"messages": USER, "thinking_token_budget": 0})
    assert caught.value.param == "thinking_token_budget"
