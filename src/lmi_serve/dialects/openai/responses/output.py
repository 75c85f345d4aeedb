"""Response objects and their output items, as openai.types.responses has them.

One chat answer becomes, in order: a `reasoning` item (the reasoning block, as `reasoning_text`
content), then either `function_call` items (the tool calls) or one assistant `message` with one
`output_text` part (always one when there are no calls, even empty, so a stream and a whole response
hold the same items). An answer cut short by `max_output_tokens` makes the response `incomplete`
(`incomplete_details.reason: max_output_tokens`) and its last item `incomplete`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from lmi_serve.dialects.openai.responses.request import FunctionChoice, ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- items --------------------------------------------------------------------------------------

def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message; `text` None while it is being written (no part yet)."""
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [reasoning_part(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_items(message: dict, cut_short: bool) -> list[dict]:
    """The items of one whole chat `message` (the chat completion's choice); `cut_short`: it ended
    at the token limit."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    for call in message.get("tool_calls") or ():
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    if not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed"))
    if cut_short:
        items[-1]["status"] = "incomplete"
    return items


# ---- the response -------------------------------------------------------------------------------

def usage(chat_usage: dict) -> dict:
    """Chat usage as Responses usage (reasoning tokens counted among the output tokens)."""
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def _text_config(request: ResponsesRequest) -> dict:
    fmt = request.text_format
    echoed = {"type": fmt.type}
    if fmt.type == "json_schema":
        echoed.update(name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description)
    return {"format": echoed, "verbosity": "medium"}


def _tools(request: ResponsesRequest) -> list[dict]:
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict} for t in request.tools or ()]


def _tool_choice(request: ResponsesRequest) -> str | dict:
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


@dataclass
class ResponseShell:
    """What every state of one response shares: its id, creation time, model and the request it echoes."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], chat_usage: dict | None = None, *,
             error: dict | None = None) -> dict:
        """The Response object in `status`: in_progress, completed, incomplete or failed."""
        request = self.request
        reasoning = request.reasoning
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "model": self.model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls, "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "text": _text_config(request), "tool_choice": _tool_choice(request), "tools": _tools(request),
            "truncation": "disabled", "background": False, "service_tier": "default",
            "user": request.user, "safety_identifier": request.safety_identifier,
            "prompt_cache_key": request.prompt_cache_key,
            "usage": usage(chat_usage) if chat_usage is not None else None,
        }


def from_chat(shell: ResponseShell, completion: dict) -> dict:
    """The whole Response of a whole chat completion (one choice)."""
    choice = completion["choices"][0]
    cut_short = choice["finish_reason"] == "length"
    return shell.body("incomplete" if cut_short else "completed", output_items(choice["message"], cut_short),
                      completion["usage"])
