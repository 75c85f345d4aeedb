"""The body of `POST /v1/responses` as a validated pydantic model (docs/openai.md, "Responses API").

Rules, as on chat completions: every validation error is a 400 naming the field; a known field this
server cannot honour is a 400 unless it holds the value that asks for nothing (`REFUSED`); truly
unknown fields are ignored and logged. Input items are checked one by one in items.py, where each
error can name its item.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lmi_serve.dialects.openai.schema import INT64_MAX, INT64_MIN, non_empty_stops
from lmi_serve.errors import InvalidRequest

# field -> (why it cannot be honoured, the values that ask for nothing and are accepted); schema.parse
# applies it through vllm.refuse, the mechanism the chat routes' vLLM fields use.
REFUSED: dict[str, tuple[str, tuple]] = {
    "background": ("background responses are not supported; the answer comes on this request", (None, False)),
    "conversation": ("the Conversations API is not served; chain turns with previous_response_id", (None,)),
    "prompt": ("stored prompt templates are not served; send the input itself", (None,)),
    "include": ("no extra output data is available (no logprobs, encrypted reasoning or built-in tool results); "
                "leave include out or send an empty list", (None, [])),
    "top_logprobs": ("logprobs are not returned on /v1/responses; use /v1/chat/completions", (None, 0)),
    "truncation": ("the input is never cut to fit: a conversation longer than the context is a 400; send "
                   "`disabled` or leave truncation out", (None, "disabled")),
    "service_tier": ("requests are served first come, first served; there are no service tiers",
                     (None, "auto", "default")),
    "context_management": ("context compaction is not supported", (None, [])),
    "moderation": ("moderation is not supported", (None,)),
    "image": ("image generation is not supported", (None,)),
    "access_programs": ("programmatic tool calling is not supported", (None,)),
    "background_options": ("background responses are not supported", (None, {})),
}
BUILT_IN_TOOLS = "only function tools are served here; built-in tools (web search, file search, code " \
                 "interpreter, computer use, MCP, image generation, shell ...) are not"


class _Lenient(BaseModel):
    """Unknown fields are kept aside (and logged by schema.parse), not rejected."""

    model_config = ConfigDict(extra="allow")


class FunctionTool(_Lenient):
    """Responses' flat function tool: `{type, name, description, parameters, strict}`."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None

    @field_validator("defer_loading")
    @classmethod
    def _no_tool_search(cls, value):
        if value:
            raise ValueError("defer_loading needs tool search, which is not supported; send false or leave it out")
        return value


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    """`text.format`: plain text, any JSON object, or a JSON schema (Structured Outputs)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_rules(self):
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a json_schema format needs `name` and `schema`")
        if self.type != "json_schema" and self.schema_ is not None:
            raise ValueError(f"a {self.type} format takes no schema")
        return self


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _neutral_verbosity(cls, value):
        if value not in (None, "medium"):
            raise ValueError(f"{value!r} cannot be honoured: an answer's length follows the model; send "
                             "'medium' or leave verbosity out")
        return value


class ReasoningConfig(_Lenient):
    """`reasoning`: `effort` goes to the chat template's switch where it has one (convert.py);
    summaries are not written ('auto' asks for whatever is available: none)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None

    @model_validator(mode="after")
    def _what_can_be_honoured(self):
        for field in ("summary", "generate_summary"):
            if getattr(self, field) not in (None, "auto"):
                raise ValueError(f"{field}: reasoning summaries are not written; the reasoning itself comes as "
                                 "`reasoning_text` content; send 'auto' or leave it out")
        if self.context not in (None, "auto"):
            raise ValueError("context: earlier turns' reasoning goes to the chat template, which keeps what "
                             "the model was trained with; send 'auto' or leave it out")
        if self.mode not in (None, "standard"):
            raise ValueError(f"mode {self.mode!r} is not available; send 'standard' or leave it out")
        return self


class StreamOptions(_Lenient):
    include_obfuscation: bool | None = None  # padding against length side channels: none is sent


class ResponsesRequest(_Lenient):
    vllm_refused: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED

    model: str | None = None
    input: str | list[Any]  # each item is checked in items.py, where its error can name it
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=32)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    # Accepted, nothing to do: ids for abuse monitoring and cache routing; a limit on built-in tool calls.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # vLLM's sampling extensions, honoured as on chat completions.
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _checked_first(cls, data):
        """Refused fields reaching here hold neutral values (nothing to do, nothing to log). A tool or
        tool choice of a built-in type is a 400 naming it, raised as the kind itself (pydantic lets it
        through) so that it names the field, before pydantic's union errors could blur it."""
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise InvalidRequest(f"tools.{i}.type: tool type {str(tool.get('type'))[:64]!r} is not supported: "
                                     f"{BUILT_IN_TOOLS}", param=f"tools.{i}.type")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise InvalidRequest(f"tool_choice.type: {str(choice.get('type'))[:64]!r} is not supported: a tool "
                                 "choice is none, auto, required or {type: function, name}", param="tool_choice.type")
        return {k: v for k, v in data.items() if k not in REFUSED}

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value):
        return non_empty_stops(value)

    @model_validator(mode="after")
    def _rules(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, FunctionChoice):
            if self.tool_choice.name not in {t.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        return self

    @property
    def stores(self) -> bool:
        """OpenAI's default: a response is stored unless `store: false`."""
        return self.store is not False

    @property
    def text_format(self) -> TextFormat:
        fmt = self.text.format if self.text is not None else None
        return fmt or TextFormat(type="text")
