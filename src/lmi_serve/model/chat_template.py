"""option.chat_template at load: the operator's template replaces the checkpoint's, in one place.

Every reader of a model's chat template reads `tokenizer.chat_template` (or, for a vision-language
model, `processor.chat_template`): OpenAI chat, LMI `messages` on /invocations, /tokenize with
messages, `use_raw_prompt: false`, the tool-call format chosen from the template and the reasoning
markers found in it. Setting both once, before the engine is built, is what makes the option apply
to all of them. A template that Jinja cannot parse fails the load, naming the option.
"""

from __future__ import annotations

import logging

from lmi_serve.config.chat_template import text_of

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """option.chat_template cannot be used (a file gone since start-up, a Jinja syntax error)."""


def override_chat_template(tokenizer, processor, value: str | None) -> bool:
    """Put option.chat_template (`value`: inline text or a file's absolute path) on `tokenizer` and on
    `processor` when there is one; False (nothing changed) without a value."""
    if value is None:
        return False
    try:
        template = text_of(value)
    except ValueError as exc:
        raise ChatTemplateError(f"option.chat_template: {exc}") from None
    _check_syntax(tokenizer, template)
    had = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = template
    if processor is not None:
        processor.chat_template = template
    where = "inline" if value == template else value
    log.info("option.chat_template (%s) replaces %s", where,
             "the checkpoint's chat template" if had else "no chat template (the checkpoint has none)")
    return True


def _check_syntax(tokenizer, template: str) -> None:
    """A syntax error fails now; a template that refuses this one-message conversation
    (raise_exception) is left to the requests, which get a 400 naming the messages."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"option.chat_template is not a valid Jinja template: {exc} (line {exc.lineno})"
                                ) from None
    except Exception:  # noqa: BLE001 - the template's own refusal of this conversation is not a load error
        pass
