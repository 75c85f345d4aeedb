"""option.chat_template at load (model/chat_template.py): the operator's template replaces the
checkpoint's on the tokenizer and on a vision-language model's processor, once, with one log line;
a template Jinja cannot parse, or a file gone since start-up, fails the load naming the option."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest

from lmi_serve.model.chat_template import ChatTemplateError, override_chat_template

PREFIX_TEMPLATE = ("{% for m in messages %}<<operator>> {{ m.role }}: {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<<operator>> assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def tokenizer(smollm2_tokenizer):
    return copy.deepcopy(smollm2_tokenizer)  # the session's tokenizer keeps the checkpoint's template


def render(tokenizer) -> str:
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_the_operators_template_replaces_the_checkpoints(tokenizer, caplog):
    checkpoint = render(tokenizer)
    with caplog.at_level(logging.INFO, logger="lmi_serve.model.chat_template"):
        assert override_chat_template(tokenizer, None, PREFIX_TEMPLATE) is True
    assert render(tokenizer) == "<<operator>> user: Hello\n<<operator>> assistant:" != checkpoint
    [record] = caplog.records
    assert "option.chat_template (inline) replaces the checkpoint's chat template" in record.getMessage()


def test_a_file_value_is_read(tokenizer, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(PREFIX_TEMPLATE)
    override_chat_template(tokenizer, None, str(path))
    assert tokenizer.chat_template == PREFIX_TEMPLATE


def test_a_vision_models_processor_gets_it_too(tokenizer):
    processor = SimpleNamespace(chat_template="{{ 'the processor template' }}", tokenizer=tokenizer)
    override_chat_template(tokenizer, processor, PREFIX_TEMPLATE)
    assert processor.chat_template == tokenizer.chat_template == PREFIX_TEMPLATE


def test_no_value_changes_nothing(tokenizer):
    before = tokenizer.chat_template
    assert override_chat_template(tokenizer, None, None) is False and tokenizer.chat_template == before


def test_a_jinja_syntax_error_fails_the_load_naming_the_option(tokenizer):
    before = tokenizer.chat_template
    with pytest.raises(ChatTemplateError, match=r"option.chat_template is not a valid Jinja template: .*line 1"):
        override_chat_template(tokenizer, None, "{% for m in messages %}{{ m.content }}")
    assert tokenizer.chat_template == before


def test_a_file_gone_since_start_up_fails_the_load_naming_the_option(tokenizer, tmp_path):
    with pytest.raises(ChatTemplateError, match=r"^option.chat_template: cannot read the template file"):
        override_chat_template(tokenizer, None, str(tmp_path / "gone.jinja"))


def test_a_template_that_refuses_the_probe_conversation_still_loads(tokenizer):
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}x"
    assert override_chat_template(tokenizer, None, strict) is True and tokenizer.chat_template == strict
