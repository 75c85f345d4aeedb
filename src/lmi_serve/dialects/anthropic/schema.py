"""Anthropic Messages request bodies as validated pydantic models.

Anthropic's API refuses a field it does not know, and so does this dialect: every field a client
sends is honoured, accepted as one that changes nothing here (`metadata`, `cache_control`,
`service_tier`, ...), or refused with a 400 naming it (`REFUSED`, and the validators below).
Every validation error is a 400 naming the field's path (`messages.0.content.1.source`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmi_serve.dialects.common.validation import FieldProblem, field_problems
from lmi_serve.errors import InvalidRequest

# Fields of Anthropic's API whose features this server does not have; any value but null is a 400.
REFUSED = {
    "container": "code-execution containers are Anthropic's server tools, which are not available here",
    "mcp_servers": "MCP servers are not called by this server; run them in the client and send their tools",
    "context_management": "context editing is not available; send the conversation as the model should read it",
    "diagnostics": "prompt-cache diagnostics are not available",
    "inference_geo": "inference runs where this server runs; a region cannot be chosen",
}

# Prompt-caching hints: accepted, with no effect (caching a prompt's prefix is the operator's
# option.enable_prefix_caching, which never changes an answer).
CacheControl = dict[str, Any] | None

_BLOCK_TAGS = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "base64", "url"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value):
        if value:
            raise ValueError("citations cannot be sent: this server neither makes nor reads them")
        return value


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl = None

    @field_validator("source", mode="before")
    @classmethod
    def _known_source(cls, value):
        if isinstance(value, dict) and value.get("type") == "file":
            raise ValueError("image sources of type 'file' (Anthropic's Files API) are not available; "
                             "send the image as base64 or a url")
        return value

    @property
    def url(self) -> str:
        """The image as the chat service takes it: a data URI, or the URL."""
        source = self.source
        return source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        for i, block in enumerate(value if isinstance(value, list) else ()):
            if isinstance(block, dict) and block.get("type") != "text":
                raise ValueError(f"block {i}: a tool result holds text here; blocks of type "
                                 f"{block.get('type')!r} in a tool result are not supported")
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    """An earlier answer's thinking, sent back (its `signature` is whatever this server sent: empty)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
_ROLE_BLOCKS = {"user": {"text", "image", "tool_result"}, "assistant": {"text", "tool_use", "thinking"},
                "system": {"text"}}


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_the_role(self):
        for i, block in enumerate(self.blocks):
            if block.type not in _ROLE_BLOCKS[self.role]:
                raise ValueError(f"content.{i}: {block.type} blocks belong in "
                                 f"{'user' if block.type in _ROLE_BLOCKS['user'] else 'assistant'} messages, "
                                 f"not {self.role} ones")
        return self

    @property
    def blocks(self) -> list:
        """The content as blocks (a string is one text block)."""
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(_Strict):
    """A client tool. Anthropic's server tools (a `type` such as `web_search_20250305`) are refused
    in MessagesFields' validator, by their type."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None  # the grammar always holds the input to its schema
    eager_input_streaming: bool | None = None  # the input always streams as it is written

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, value):
        if value.get("type") != "object":
            raise ValueError("input_schema must be a JSON Schema of type 'object'")
        return value


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool_choice of type 'tool' names the tool, and only that type takes a name")
        return self


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens is required with type 'enabled', and taken with no other type")
        return self


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: str | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value):
        if value is not None:
            raise ValueError("effort cannot be set: open models have no effort levels; bound thinking with "
                             "thinking.budget_tokens")
        return value


class Metadata(_Strict):
    user_id: str | None = None  # accepted: an id for abuse monitoring, nothing to do with it here


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what a message's prompt is made of."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    speed: str | None = None
    user_profile_id: str | None = None  # accepted: account attribution, nothing to do with it here
    workspace_id: str | None = None  # accepted: account attribution, nothing to do with it here

    @field_validator("speed")
    @classmethod
    def _one_speed(cls, value):
        if value not in (None, "standard"):
            raise ValueError(f"{value!r} is not available: this server has one speed, 'standard'")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tool {i} is of type {kind!r}, one of Anthropic's server tools, which are not "
                                 "available here; define a client tool with name and input_schema")
        return value

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools or ()}:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice of type {choice.type!r} needs tools")
        return self

    @property
    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(block.text for block in self.system)
        return self.system


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic has it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either answers the same

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value):
        if any(not stop for stop in value or ()):
            raise ValueError("stop sequences must not be empty")
        return value

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        if self.thinking is not None and (self.thinking.budget_tokens or 0) >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens (thinking counts toward it)")
        return self


_BRANCH_TYPES = frozenset({"str", "int", "float", "bool", "dict", "list"})


def _path(problem: FieldProblem) -> str:
    """The dotted path of `problem`, without the names pydantic gives a union's branches (`str`,
    `list[...]`, a block's `type` tag)."""
    loc = [str(part) for part in problem.loc]

    def tag(i: int) -> bool:  # a block's or a source's `type`, which pydantic puts in the path of its fields
        return loc[i] in _BLOCK_TAGS and 0 < i < len(loc) - 1 and (loc[i - 1].isdigit() or loc[i - 1] == "source")

    kept = [part for i, part in enumerate(loc)
            if not ("[" in part or part in _BRANCH_TYPES or part.startswith(("function-", "union")) or tag(i))]
    return ".".join(kept)


def _most_telling(problems: list[FieldProblem]) -> FieldProblem:
    """The first problem that is not merely a union branch of the wrong type (a list of blocks
    is not a string), else the first."""
    def branch_only(problem: FieldProblem) -> bool:
        last = str(problem.loc[-1]) if problem.loc else ""
        return (last in _BRANCH_TYPES or "[" in last) and problem.message.startswith("Input should be a valid")

    telling = [p for p in problems if not branch_only(p)]
    return (telling or problems)[0]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; raise InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    for field, reason in REFUSED.items():
        if body.get(field) is not None:
            raise InvalidRequest(f"{field}: not supported: {reason}", param=field)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problem = _most_telling(field_problems(exc))
        path = _path(problem)
        raise InvalidRequest(f"{path}: {problem.message}" if path else problem.message, param=path or None) from None
