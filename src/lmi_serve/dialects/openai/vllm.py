"""vLLM's extension fields on the OpenAI routes: each is honoured on this engine or refused.

vLLM clients send fields OpenAI does not define; most change what comes back, so dropping them
would hand back results the client did not ask for. This module owns them:
- `VllmChatFields` / `VllmCompletionFields`: the fields honoured, mixed into the request models;
- `REFUSED` (both routes), `REFUSED_CHAT`, `REFUSED_COMPLETION`: fields vLLM defines that this
  server cannot honour. A neutral value (the one that asks for nothing, e.g. `use_beam_search:
  false`) is accepted; any other value is a 400 naming the field (`refuse`, called by `parse`);
- the chat template fields `chat_template` and `chat_template_kwargs`, checked in templates.py;
- `extend`: the honoured fields as neutral engine parameters on the GenerationRequests;
- rendering: `prompt_logprobs` in vLLM's shape, chat `echo`, `request_id` as the response id.
Truly unknown fields stay ignored and logged by `schema.parse` (benchmarks send bookkeeping).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.openai.templates import check_template_kwargs
from lmi_serve.engine.sampling.grammar import GrammarError
from lmi_serve.engine.types import DetokenizeParams, GenerationRequest, GuidedDecoding, TokenEvent
from lmi_serve.errors import InvalidRequest

MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs

_BACKEND = ("this server's structured output always uses llguidance (vLLM's `guidance` backend); "
            "leave it out or send `guidance`")

# field -> (why it cannot be honoured, the values that ask for nothing and are accepted)
REFUSED: dict[str, tuple[str, tuple]] = {
    "use_beam_search": ("beam search is not available on the OpenAI routes; use the LMI route's num_beams",
                        (None, False)),
    "length_penalty": ("length_penalty only applies to beam search, which the OpenAI routes do not run",
                       (None, 1, 1.0)),
    "early_stopping": ("early_stopping only applies to beam search, which the OpenAI routes do not run",
                       (None, False)),
    "priority": ("requests are served first come, first served; there is no priority scheduling", (None, 0)),
    "logits_processors": ("custom logits processors cannot be loaded by name", (None, [])),
    "return_tokens_as_token_ids": ("logprob tokens are always returned as text", (None, False)),
    "return_token_ids": ("token ids are not returned alongside the text", (None, False)),
    "kv_transfer_params": ("there is no disaggregated prefill (KV transfer)", (None, {})),
    "vllm_xargs": ("there are no custom extensions to pass arguments to", (None, {})),
    "guided_decoding_backend": (_BACKEND, (None, "", "auto", "guidance", "llguidance")),
    "guided_whitespace_pattern": ("JSON output always uses the compact layout `, ` / `: `; "
                                  "a custom whitespace pattern is not supported", (None,)),
    "max_repetition_pattern_size": ("repetition detection is not supported", (None, 0)),
    "min_repetition_pattern_size": ("repetition detection is not supported", (None, 0)),
    "repetition_min_count": ("repetition detection is not supported", (None, 0)),
    "logprob_token_ids": ("logprobs of chosen token ids are not returned; use logprobs (the sampled token and "
                          "the top alternatives)", (None, [])),
}
REFUSED_CHAT: dict[str, tuple[str, tuple]] = {
    **REFUSED,
    "add_generation_prompt": ("the prompt always ends with the assistant's generation prompt", (None, True)),
    "continue_final_message": ("the final message cannot be continued; the reply is a new assistant message",
                               (None, False)),
    "documents": ("documents are not passed to the chat template", (None, [])),
    "mm_processor_kwargs": ("this model takes text only", (None, {})),
    "media_io_kwargs": ("this model takes text only", (None, {})),
    "best_of": ("best_of is a /v1/completions parameter; chat returns n choices", (None, 1)),
}
REFUSED_COMPLETION: dict[str, tuple[str, tuple]] = {
    **REFUSED,
    "prompt_embeds": ("prompts are text or token ids; embeddings cannot be sent", (None, [])),
}

def refuse(model: type[BaseModel], body: dict) -> None:
    """400 naming the first refused field `body` sets to something other than a neutral value."""
    table = getattr(model, "vllm_refused", None)
    for field, (reason, neutral) in (table or {}).items():
        if field in body and not any(_same(body[field], value) for value in neutral):
            raise InvalidRequest(f"Unsupported parameter `{field}`: {reason}", param=field)


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind (so `priority: false` is not taken for 0)."""
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, float) and isinstance(neutral, int) and not isinstance(neutral, bool) and value == neutral)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object. Exactly one constraint is set."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    # Accepted: this server never falls back to another backend, and its JSON layout has no free
    # whitespace (`disable_any_whitespace` asks for that).
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structural_tag is not None:
            raise ValueError("structural_tag is not supported; use json, regex, choice or grammar")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported: JSON output always uses the compact layout")
        if self.disable_additional_properties:
            raise ValueError("disable_additional_properties is not supported; "
                             "set additionalProperties: false in the schema")
        set_ = [name for name in ("json", "regex", "choice", "grammar", "json_object") if self.value_of(name)]
        if len(set_) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object"
                             + (f" (got {', '.join(set_)})" if set_ else ""))
        return self

    def value_of(self, name: str):
        return self.json_ if name == "json" else getattr(self, name)


class VllmFields(BaseModel):
    """vLLM's sampling and output fields shared by chat and completions (see the module docstring)."""

    model_config = ConfigDict(extra="allow")
    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED

    min_tokens: int = Field(0, ge=0)
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # Where truncate_prompt_tokens cuts: `left` (vLLM's default) keeps the last N tokens, `right` the first N.
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # Salts a prefix cache shared between requests; this engine shares no KV cache between
    # requests, so the isolation it asks for always holds.
    cache_salt: str | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_refused(cls, data):
        """Refused fields reaching here hold neutral values (`refuse` ran first): nothing to do,
        and nothing to log as ignored."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in cls.vllm_refused}
        return data

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_rule(cls, value):
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context) or at least 1")
        return value

    @field_validator("bad_words")
    @classmethod
    def _non_empty_words(cls, value):
        if any(not word.strip() for word in value):
            raise ValueError("bad_words must not contain empty words")
        return value

    @property
    def wants_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class VllmChatFields(VllmFields):
    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED_CHAT

    echo: bool = False  # the reply starts with the last message's content when that is an assistant message
    add_special_tokens: bool = False  # the chat template writes the special tokens
    # Reasoning models (openai/reasoning.py): false leaves `reasoning_content` out (it is still generated);
    # thinking_token_budget bounds the reasoning block's tokens.
    include_reasoning: bool = True
    thinking_token_budget: int | None = Field(None, ge=1)
    # Extra variables for the chat template (e.g. Qwen3's `enable_thinking`), as on /tokenize.
    chat_template_kwargs: dict[str, Any] | None = None
    # This request's chat template, in place of the model's (check_request_template), as on /tokenize.
    chat_template: str | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_rule(cls, value):
        return check_template_kwargs(value)

    @property
    def wants_prompt_logprobs(self) -> int | None:
        """vLLM: chat `echo` without `prompt_logprobs` asks for the prompt's logprobs (top_logprobs each)."""
        if self.prompt_logprobs is None and self.echo and not getattr(self, "stream", False):
            return getattr(self, "top_logprobs", None) or 0
        return self.prompt_logprobs


class CompletionJsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")


class CompletionResponseFormat(BaseModel):
    """vLLM's `response_format` on /v1/completions (chat has its own, in schema.py)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: CompletionJsonSchema | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class VllmCompletionFields(VllmFields):
    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED_COMPLETION

    add_special_tokens: bool = True  # e.g. BOS, when the tokenizer adds one
    response_format: CompletionResponseFormat | None = None


# ---- request side ---------------------------------------------------------------------------------

def truncate_prompt(ids: Sequence[int], fields: BaseModel, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens`: keep the last N prompt tokens (-1: the model's context length), or
    the first N with `truncation_side: right`."""
    keep = getattr(fields, "truncate_prompt_tokens", None)
    if keep is None:
        return list(ids)
    keep = max_model_len if keep == -1 else keep
    return truncated(ids, keep, getattr(fields, "truncation_side", None))


def truncated(ids: Sequence[int], keep: int, side: str | None) -> list[int]:
    """At most `keep` of `ids`: the last ones (side `left` or None, vLLM's default), or the first."""
    return list(ids)[:keep] if side == "right" else list(ids)[-keep:]


def _guided_fields(fields: VllmFields) -> list[tuple[str, GuidedDecoding]]:
    """(field name for errors, grammar) for every vLLM constraint the request sets."""
    found: list[tuple[str, GuidedDecoding]] = []
    so = fields.structured_outputs
    if so is not None:
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            if so.value_of(name):
                param = f"structured_outputs.{name}"
                found.append((param, _grammar(name, so.value_of(name), param)))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(fields, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", _grammar(name, value, f"guided_{name}")))
    fmt = getattr(fields, "response_format", None)
    if isinstance(fmt, CompletionResponseFormat) and fmt.type != "text":
        kind, value = ("json", fmt.json_schema.schema_) if fmt.type == "json_schema" else ("json_object", True)
        found.append(("response_format", _grammar(kind, value, "response_format")))
    return found


def _grammar(kind: str, value, param: str) -> GuidedDecoding:
    if kind == "json":
        return guided.json_schema(value, param)
    if kind == "json_object":
        return guided.any_object()
    if kind == "regex":
        return guided.regex(value, param)
    if kind == "choice":
        return GuidedDecoding(lark="start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value) + "\n")
    return GuidedDecoding(lark=value)  # guided_grammar: llguidance's Lark dialect


def _guided(engine, fields: VllmFields, current: GuidedDecoding | None) -> GuidedDecoding | None:
    found = _guided_fields(fields)
    if not found:
        return current
    param, chosen = found[0]
    if len(found) > 1:
        raise InvalidRequest(f"Only one structured output constraint is allowed; got "
                             f"{', '.join(name for name, _ in found)}", param=found[1][0])
    if current is not None:
        raise InvalidRequest(f"`{param}` cannot be combined with response_format or tools, which already "
                             "constrain the output", param=param)
    try:
        engine.grammars.constraint(chosen)  # compiled here too, so an error names the field
    except GrammarError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None
    return chosen


def _token_ids(values: Sequence[int], vocab: int, param: str) -> frozenset[int]:
    bad = [t for t in values if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{param}: token id {bad[0]} is outside the vocabulary of {vocab}", param=param)
    return frozenset(values)


def bad_word_sequences(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, as written at the start of the text and after a space."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            sequences[tuple(tokenizer.encode(text, add_special_tokens=False))] = None
    return tuple(s for s in sequences if s)


def extend(engine, fields: BaseModel, requests: list[GenerationRequest]) -> list[GenerationRequest]:
    """The vLLM fields of `fields` on every request of one prompt; a 400 naming the field when one
    cannot apply (a second grammar, min_tokens over max_tokens, prompt_logprobs on a stream ...)."""
    if not isinstance(fields, VllmFields) or not requests:
        return requests
    first = requests[0]
    if fields.min_tokens > first.stop.max_new_tokens:
        raise InvalidRequest(f"min_tokens ({fields.min_tokens}) must not exceed max_tokens "
                             f"({first.stop.max_new_tokens})", param="min_tokens")
    if fields.prompt_logprobs is not None and getattr(fields, "stream", False):
        raise InvalidRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    vocab = engine.vocab_size
    allowed = _token_ids(fields.allowed_token_ids, vocab, "allowed_token_ids") \
        if fields.allowed_token_ids is not None else None
    banned = bad_word_sequences(engine.tokenizer, fields.bad_words)
    guided = _guided(engine, fields, first.guided)
    prompt_top = fields.wants_prompt_logprobs
    detokenize = DetokenizeParams(fields.skip_special_tokens, fields.spaces_between_special_tokens)
    return [dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, allowed_token_ids=allowed, banned_sequences=banned),
        stop=dataclasses.replace(request.stop, min_new_tokens=fields.min_tokens), guided=guided,
        prompt_logprobs=request.prompt_logprobs or prompt_top is not None, prompt_top_n=prompt_top or 0,
        detokenize=detokenize) for request in requests]


# ---- response side --------------------------------------------------------------------------------

def response_meta(meta, fields: BaseModel):
    """vLLM's response id: `<prefix>-<request_id>` when the client named its request."""
    request_id = getattr(fields, "request_id", None)
    if not request_id:
        return meta
    prefix = meta.id.split("-", 1)[0]
    return dataclasses.replace(meta, id=f"{prefix}-{request_id}")


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -Infinity; vLLM clamps the same way


def prompt_logprobs(event: TokenEvent | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict from token
    id to {logprob, rank, decoded_token}: the prompt token itself, then the requested alternatives."""
    if event is None or event.prompt_tokens is None:
        return None
    alternatives = event.prompt_top_tokens or ((),) * len(event.prompt_tokens)
    positions: list[dict | None] = [None]
    for token, best in zip(event.prompt_tokens[1:], alternatives[1:]):
        entry = {}
        for candidate in (token, *best):
            entry.setdefault(str(candidate.token_id), {"logprob": _logprob(candidate.logprob), "rank": candidate.rank,
                                                       "decoded_token": candidate.text})
        positions.append(entry)
    return positions


def _first_event(events: Sequence[TokenEvent]) -> TokenEvent | None:
    return events[0] if events else None


def finish_chat(body: dict, fields: BaseModel, states: Sequence) -> dict:
    """A whole chat body with vLLM's `echo` and `prompt_logprobs` applied."""
    if not isinstance(fields, VllmChatFields):
        return body
    echo = echo_text(fields)
    if echo:
        for choice in body["choices"]:
            choice["message"]["content"] = echo + (choice["message"].get("content") or "")
    if fields.wants_prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(_first_event(states[0].events))
    return body


def finish_completion(body: dict, fields: BaseModel, states: Sequence) -> dict:
    """A whole completions body with each choice's vLLM `prompt_logprobs` (states index-aligned)."""
    if isinstance(fields, VllmFields) and fields.prompt_logprobs is not None:
        for choice, state in zip(body["choices"], states):
            choice["prompt_logprobs"] = prompt_logprobs(_first_event(state.events))
    return body


def echo_text(fields: BaseModel) -> str:
    """vLLM's chat `echo`: the last message's content when it is the reply's role (assistant)."""
    if not getattr(fields, "echo", False) or not isinstance(fields, VllmChatFields):
        return ""
    last = fields.messages[-1]
    return last.text if last.role == "assistant" else ""


def echo_chunks(chunks: Iterator[dict], fields: BaseModel) -> Iterator[dict]:
    """A chat stream with the echoed text sent right after each choice's role chunk."""
    echo = echo_text(fields)
    for chunk in chunks:
        yield chunk
        if not echo:
            continue
        for choice in chunk.get("choices", ()):
            if "role" in choice.get("delta", {}):
                yield {**chunk, "choices": [{"index": choice["index"], "delta": {"content": echo},
                                             "logprobs": None, "finish_reason": None}]}
