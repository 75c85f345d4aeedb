"""vLLM's chat template fields, on chat completions and /tokenize alike.

- `chat_template_kwargs`: extra variables for the template (`check_template_kwargs`);
- `chat_template`: the request's own template, in place of the model's (`check_request_template`),
  honoured only where the operator trusts clients' templates (option.trust_request_chat_template,
  vLLM's --trust-request-chat-template), else a 400 naming the field and the option. A template
  smuggled in as `chat_template_kwargs.chat_template` is always refused: it would skip that check.
"""

from __future__ import annotations

from pydantic import BaseModel

from lmi_serve.errors import InvalidRequest

# apply_chat_template's own arguments: a client's template variables may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_tensors", "return_dict", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask"})


def check_template_kwargs(kwargs: dict | None) -> dict | None:
    """vLLM's `chat_template_kwargs` (chat and /tokenize): extra variables for the chat template,
    such as Qwen3's `enable_thinking`. Variables the template does not read are harmless, as in
    transformers; names of apply_chat_template's own arguments are refused (a ValueError naming
    them), since the request's own fields set those."""
    reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                         "apply_chat_template takes them from the request's own fields")
    return kwargs


def check_request_template(fields: BaseModel, trusted: bool) -> str | None:
    """vLLM's request `chat_template` (chat and /tokenize): the template to render this request's
    messages with, in place of the model's; None when the request sends none (or an empty one).
    Honoured only where the operator trusts clients' templates (option.trust_request_chat_template,
    vLLM's --trust-request-chat-template): a client's Jinja is code, run in transformers' sandbox,
    whose rendering can still cost much CPU and memory. Otherwise a 400 naming the field and the option."""
    template = getattr(fields, "chat_template", None)
    if not template:
        return None
    if not trusted:
        raise InvalidRequest("Unsupported parameter `chat_template`: this model renders messages with its own chat "
                             "template; a request's template is honoured only when the server is started with "
                             "option.trust_request_chat_template=true (OPTION_TRUST_REQUEST_CHAT_TEMPLATE)",
                             param="chat_template")
    return template


def trusts_request_template(service) -> bool:
    """option.trust_request_chat_template of the model `service` serves (false for a test double)."""
    return bool(getattr(getattr(service, "config", None), "trust_request_chat_template", False))
