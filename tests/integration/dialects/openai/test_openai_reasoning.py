"""A reasoning model over HTTP (the shared tiny store, integration/conftest.py): a tiny random Llama with SmolLM2's vocabulary plus `<think>` /
`</think>` tokens and the real DeepSeek-R1-Distill-Qwen chat template (its prompt opens the block).
A seed makes every run alike. A token budget (option.max_reasoning_tokens, which vLLM's
`thinking_token_budget` may lower) makes the grammar close the block after a few tokens, and
response_format / tools decide the answer, so the split is forced whatever the random weights pick. Checked with the official `openai` client: `reasoning_content`, streamed = whole,
usage's reasoning tokens, include_reasoning, tool calls after the block, and /invocations alike."""

from __future__ import annotations

import json
import re

import pytest
import requests

from tiny_store import REASONER, REASONING_BUDGET as BUDGET

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "What is 2+2?"}]
REGEX = "The answer is [0-9]"
# Seeded sampling: reproducible, and unlike greedy decoding the random weights do not pick only whitespace.
BASE = {"model": REASONER, "messages": USER, "seed": 0, "max_tokens": 24,
        "extra_body": {"response_format": {"type": "regex", "value": REGEX}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # the shared tiny store (integration/conftest.py): this module's model is `tiny`


@pytest.mark.parametrize("budget", [None, 1])
def test_reasoning_content_then_the_answer_with_reasoning_tokens_counted(server, openai_client, budget):
    body = BASE if budget is None else {**BASE, "extra_body": {**BASE["extra_body"], "thinking_token_budget": budget}}
    completion = openai_client(server).chat.completions.create(**body)
    message = completion.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "think>" not in reasoning
    assert re.fullmatch(REGEX, message.content)
    details = completion.usage.completion_tokens_details
    assert 1 <= details.reasoning_tokens <= (budget or BUDGET) + 1  # the budget's tokens and the closing marker
    assert completion.usage.completion_tokens > details.reasoning_tokens


def test_streamed_equals_whole(server, openai_client):
    client = openai_client(server, strict=False)
    whole = client.chat.completions.create(**BASE).choices[0].message
    thought, content, usage = [], [], None
    for chunk in client.chat.completions.create(**BASE, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(thought) == whole.model_extra["reasoning_content"]
    assert "".join(content) == whole.content
    assert not any("think>" in piece for piece in thought + content)
    assert usage.completion_tokens_details.reasoning_tokens >= 1


def test_include_reasoning_false_leaves_it_out(server, openai_client):
    body = {**BASE, "extra_body": {**BASE["extra_body"], "include_reasoning": False}}
    completion = openai_client(server).chat.completions.create(**body)
    assert "reasoning_content" not in (completion.choices[0].message.model_extra or {})
    assert re.fullmatch(REGEX, completion.choices[0].message.content)
    assert completion.usage.completion_tokens_details.reasoning_tokens >= 1  # still generated


def test_tool_calls_come_after_the_reasoning(server, openai_client):
    # The R1 template implies DeepSeek's tool tokens (deepseek_v3), which SmolLM2's vocabulary spells in bytes:
    # room for a whole call after the reasoning
    body = {**BASE, "max_tokens": 200, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "extra_body": {}}
    message = openai_client(server).chat.completions.create(**body).choices[0].message
    assert message.model_extra["reasoning_content"]
    assert message.tool_calls[0].function.name == "add"
    assert isinstance(json.loads(message.tool_calls[0].function.arguments)["x"], int)


def test_lmi_invocations_with_messages_answers_the_same(server, openai_client):
    whole = openai_client(server).chat.completions.create(**BASE).choices[0].message
    body = {k: v for k, v in BASE.items() if k not in ("extra_body", "model")} | BASE["extra_body"]
    reply = requests.post(server.url("/invocations"), params={"model_name": REASONER}, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning_content"] == whole.model_extra["reasoning_content"]
    assert message["content"] == whole.content
