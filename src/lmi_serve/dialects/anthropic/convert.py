"""An Anthropic Messages request as the neutral chat request the chat service prepares for the engine.

- `system` (a string or text blocks) is the first system message; a message of role `system` stays
  where it is;
- consecutive messages of one role are one turn, as Anthropic combines them;
- a user turn's `tool_result` blocks become `tool` messages (an error result's text starts with
  `Error: `), its text and image blocks a user message, in the order sent;
- an assistant turn's `tool_use` blocks become its tool calls, its `thinking` blocks its
  `reasoning_content` (the chat template shows it where it reads it);
- a conversation ending with an assistant turn asks Anthropic's models to continue that turn
  (prefill); the chat service always opens a new turn, so that is a 400, as on Anthropic's newer models;
- `tools` and `tool_choice` map onto the chat's (`any` is `required`, `disable_parallel_tool_use`
  is `parallel_tool_calls: false`); `output_config.format` is a JSON-schema response_format;
- `thinking` sets the chat template's `enable_thinking` (Qwen3's switch; other templates ignore it)
  and, when enabled, the reasoning token budget.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from lmi_serve.dialects.anthropic.schema import (
    CountTokensRequest, ImageBlock, Message, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock,
)
from lmi_serve.dialects.common.validation import field_problems
from lmi_serve.dialects.openai.schema import ChatCompletionRequest
from lmi_serve.errors import InvalidRequest


def _turns(messages: list[Message]) -> list[tuple[int, str, list]]:
    """(index of the turn's first message, role, blocks) with consecutive user or assistant messages merged."""
    turns: list[tuple[int, str, list]] = []
    for index, message in enumerate(messages):
        if turns and turns[-1][1] == message.role and message.role != "system":
            turns[-1][2].extend(message.blocks)
        else:
            turns.append((index, message.role, list(message.blocks)))
    return turns


def _user_messages(blocks: list) -> list[dict]:
    """A user turn: each tool result a `tool` message, runs of text and images a user message."""
    out: list[dict] = []
    parts: list[dict] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            text = f"Error: {block.text}" if block.is_error else block.text
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.url}})
        else:
            parts.append({"type": "text", "text": block.text})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(blocks: list) -> dict:
    texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    message: dict[str, Any] = {"role": "assistant", "content": texts or ("" if not calls else None)}
    if calls:
        message["tool_calls"] = calls
    if thought:
        message["reasoning_content"] = thought
    return message


def chat_messages(request: CountTokensRequest) -> list[dict]:
    turns = _turns(request.messages)
    first, role, _ = turns[-1]
    if role == "assistant":
        raise InvalidRequest(f"messages.{first}: the conversation ends with an assistant turn, which Anthropic's "
                             "models may continue (prefill); this server always answers with a new turn: end "
                             "with a user message", param=f"messages.{first}")
    out = [{"role": "system", "content": request.system_text}] if request.system_text is not None else []
    for _, role, blocks in turns:
        if role == "user":
            out += _user_messages(blocks)
        elif role == "assistant":
            out.append(_assistant_message(blocks))
        else:
            out.append({"role": "system", "content": "\n".join(block.text for block in blocks)})
    return out


def _tools(request: CountTokensRequest) -> dict:
    if not request.tools:
        return {}
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": tool.name, "parameters": tool.input_schema,
        **({"description": tool.description} if tool.description is not None else {})}} for tool in request.tools]}
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _thinking(request: CountTokensRequest) -> dict:
    thinking = request.thinking
    if thinking is None or thinking.type == "adaptive":  # the model's own default
        return {}
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking.type == "enabled"}}
    if thinking.budget_tokens is not None:
        fields["thinking_token_budget"] = thinking.budget_tokens
    return fields


def _sampling(request: CountTokensRequest) -> dict:
    if not isinstance(request, MessagesRequest):
        return {}
    fields = {"max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
              "top_k": request.top_k, "stop": request.stop_sequences}
    return {name: value for name, value in fields.items() if value is not None}


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that asks the model what `request` asks (see the module docstring)."""
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request), **_tools(request),
                            **_thinking(request), **_sampling(request)}
    output = request.output_config
    if output is not None and output.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": output.format.schema_}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # what the chat request refuses beyond Anthropic's own rules
        problem = field_problems(exc)[0]
        raise InvalidRequest(f"{problem.message} (in the chat request made of this one, at "
                             f"{'.'.join(str(part) for part in problem.loc)})") from None
