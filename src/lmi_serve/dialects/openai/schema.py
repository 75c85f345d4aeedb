"""OpenAI request bodies (chat, completions, embeddings) as validated pydantic models.

Rules (see docs/openai.md):
- every validation error is a 400 naming the field (`param`) and the rule;
- unknown fields are ignored and logged, so `vllm bench serve`, guidellm and other tools work;
- known OpenAI fields this server cannot honour are rejected (`REJECTED_FIELDS`), never dropped;
- vLLM's sampling extensions that the engine supports are honoured: top_k, min_p,
  repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output; the rest of vLLM's
  fields are honoured or refused in `vllm.py`.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from lmi_serve import echo
from lmi_serve.dialects.common.validation import FieldProblem, field_problems
from lmi_serve.dialects.openai.vllm import VllmChatFields, VllmCompletionFields, refuse
from lmi_serve.errors import InvalidRequest

log = logging.getLogger(__name__)

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# OpenAI bounds integers to int64; larger ones would overflow the engine's tensors.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Token ids are JSON integers only (true or 1.0 would be coerced); the vocabulary bound is checked
# against the model, where the 400 can name the id (prompts and inputs: the whole range there).
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")

# Known fields with no meaning here: a client sending them expects something we do not do.
REJECTED_FIELDS = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated `functions` parameter is not supported; use `tools`",
    "function_call": "the deprecated `function_call` parameter is not supported; use `tool_choice`",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort cannot be set; bound a reasoning model's block with thinking_token_budget",
}


def non_empty_stops(value):
    """`stop` as given (a string or a list of them), after checking no stop string is empty."""
    stops = [value] if isinstance(value, str) else value or []
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return value


class _Lenient(BaseModel):
    """Unknown fields are kept aside (and logged by `parse`), not rejected."""

    model_config = ConfigDict(extra="allow")


class SamplingFields(_Lenient):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # 0 and -1: no top-k filter (vLLM)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None  # an end-user id for abuse monitoring: accepted, nothing to do with it

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value):
        return non_empty_stops(value)

    @field_validator("logit_bias")
    @classmethod
    def _integer_keys(cls, value):
        for key in value or {}:
            if not _TOKEN_ID_KEY.fullmatch(key):  # ASCII digits: isdigit() also passes "²", which int() refuses
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
        return value

    @model_validator(mode="after")
    def _stream_rules(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.n > 1 and self.temperature == 0:
            raise ValueError("n > 1 needs sampling: with temperature 0 every choice would be the same")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # low / high: a 400 (openai/images.py refuse_detail)


class ImageURLPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


_PARTS = {"text": TextPart, "image_url": ImageURLPart}


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict = "{}"


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_rules(self):
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") not in _PARTS:
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; "
                                     "parts are text, or image_url for a vision-language model")
                _PARTS[part["type"]].model_validate(part)
                if part["type"] == "image_url" and self.role != "user":
                    raise ValueError(f"image_url parts belong in user messages, not {self.role} ones")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    @property
    def text(self) -> str:
        """The text parts, joined (image parts are `image_urls`)."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content if part["type"] == "text")
        return self.content or ""

    @property
    def image_urls(self) -> list[tuple[int, str]]:
        """(index in content, URL) of each image_url part."""
        if not isinstance(self.content, list):
            return []
        return [(i, part["image_url"]["url"]) for i, part in enumerate(self.content) if part["type"] == "image_url"]


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, value):
        if "name" not in value:
            raise ValueError("tool_choice.function needs a name")
        return value


class JsonSchemaFormat(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's types, and TGI's Messages API forms: `json_object` (or `json`) with a schema in
    `value`, `regex` with a pattern in `value`, `json_schema` with `{name, schema}` in `value`."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: Any = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None and isinstance(self.value, dict):
            self.json_schema = JsonSchemaFormat.model_validate({"name": "schema", **self.value})
            self.value = None
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.value is not None and self.type in ("text", "json_schema"):
            raise ValueError(f"response_format of type {self.type} takes no value")
        if self.value is None and self.type in ("json", "regex"):
            raise ValueError(f"response_format of type {self.type} needs a value (a "
                             f"{'schema' if self.type == 'json' else 'pattern'})")
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        return self


class ChatCompletionRequest(VllmChatFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=32)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None  # accepted as OpenAI does without `store`: nothing to keep

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tools is not None and not self.tools:
            raise ValueError("tools must not be an empty array")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or ()}
            if self.tool_choice.function["name"] not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function['name']!r}, which is not in tools")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` when tools are given, else `none`."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice


class CompletionRequest(VllmCompletionFields, SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    error_behavior: Literal["error", "truncate"] = "error"
    use_raw_prompt: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a token-id prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _best_of_rules(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class EmbeddingRequest(_Lenient):
    """OpenAI's embeddings body with vLLM's pooling fields: `truncate_prompt_tokens` and
    `truncation_side` (applied in routes.embeddings), `embed_dtype` and `endianness` (the layout of
    `base64` vectors; a float list is unchanged by them, as in vLLM), `use_activation` and its older
    spelling `normalize` (whether the vectors are L2-normalised; unset: as the checkpoint declares),
    `prompt_name` (one of the model's sentence-transformers prompts), `request_id` (the response's
    id, `embd-<request_id>`), `cache_salt` (no KV cache is shared between embedding requests, so
    the isolation it asks for holds); `add_special_tokens: false`, a `priority`, `padding:
    max_length` and `mm_processor_kwargs` are refused (see vllm_refused). Every field vLLM's
    EmbeddingCompletionRequest declares is one of these (tests/unit/dialects/test_openai_vllm_pooling.py)."""

    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = {
        "add_special_tokens": ("texts are always embedded with the tokenizer's special tokens, as the model was "
                               "trained; send token ids to choose every token", (None, True)),
        "priority": ("requests are served first come, first served; there is no priority scheduling", (None, 0)),
        # vLLM's `max_length` embeds the pad tokens as part of the input (for models trained at a fixed
        # length without an attention mask); padding every input to the model's limit costs that many
        # tokens of compute, and the padded ids can be sent as token ids instead: the same result.
        "padding": ("inputs are embedded as they are (vLLM's `do_not_pad`); to embed pad tokens, send the padded "
                    "token ids as `input`", (None, "do_not_pad")),
        "mm_processor_kwargs": ("the embedding models served here take text only; there is no multimodal "
                                "processor to pass arguments to", (None, {}))}

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    instruction: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    use_activation: bool | None = None
    normalize: bool | None = None
    prompt_name: str | None = None
    add_special_tokens: bool | None = None
    priority: int | None = None
    padding: str | None = None
    mm_processor_kwargs: dict | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @property
    def normalized(self) -> bool | None:
        """vLLM's rule: `use_activation`, else its older spelling `normalize`; None: the model's own."""
        return self.use_activation if self.use_activation is not None else self.normalize

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_rule(cls, value):
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's limit) or at least 1")
        return value

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        if isinstance(value, str) and not value:
            raise ValueError("input must not be an empty string")
        if isinstance(value, list) and any(isinstance(x, list) and not x for x in value):
            raise ValueError("a token-id input must not be empty")
        return value

    @property
    def token_id_inputs(self) -> list[list[int]] | None:
        """The inputs as token-id lists (one list, or a list of lists), or None for text input."""
        if isinstance(self.input, str) or all(isinstance(x, str) for x in self.input):
            return None
        return [list(self.input)] if all(isinstance(x, int) for x in self.input) else list(self.input)


SamplingFields.model_rebuild()


def _describe(problem: FieldProblem) -> tuple[str, str | None]:
    """(message, param) of one problem; param is the dotted field path, without the validator and
    union-branch names pydantic puts in its location."""
    loc = [str(part) for part in problem.loc if not str(part).startswith(("function-after", "union"))]
    param = ".".join(loc) or None
    message = echo.short(problem.message, echo.TEXT_CHARS)  # it may quote a value the client sent
    return (f"{echo.short(param)}: {message}" if param else message), (echo.short(param) if param else None)


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; raise InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    for field, reason in REJECTED_FIELDS.items():
        if body.get(field) is not None:
            raise InvalidRequest(f"Unsupported parameter `{field}`: {reason}", param=field)
    refuse(model, body)
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        problems = field_problems(exc)
        message, param = _describe(problems[0])
        count = len(problems)
        raise InvalidRequest(f"{count} validation error{'s' if count > 1 else ''}: {message}", param=param) from None
    if parsed.model_extra:
        log.warning("Ignored unknown request field(s): %s", echo.names(parsed.model_extra))
    return parsed
