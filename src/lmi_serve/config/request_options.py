"""Options for what a request may carry and how its answer is shaped: streaming and output formats,
chat templates, reasoning blocks, tool calls and images. One concern of `ModelConfig` (config/models.py
assembles them)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from lmi_serve.config import chat_template
from lmi_serve.config.fields import Options, choice, parse_bool, text

# How a reasoning model's output splits into reasoning and answer (dialects/common/reasoning.py): auto =
# gpt-oss channels or `<think>` markers where the chat template or vocabulary has them; none = all answer;
# vLLM's parser names.
ReasoningParser = Literal["auto", "none", "deepseek_r1", "qwen3", "openai_gptoss", "granite", "gemma4", "mistral"]
# How a chat model writes tool calls (dialects/openai/tool_formats/, vLLM's names); unset: from the chat template.
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "openai", "deepseek_v3",
                         "deepseek_v31", "granite", "gemma4"]
_CHOICES = {"reasoning_parser": get_args(ReasoningParser), "tool_call_parser": get_args(ToolCallParser)}


class RequestOptions(Options):
    """What requests may carry and how answers are shaped."""

    enable_streaming: bool = Field(
        False,
        description="`true`/`huggingface`: jsonlines `{\"outputs\": [...]}` (needs `batch_size=1`)",
    )
    output_formatter: str | None = Field(None, description="`json`, `jsonlines`, `sse` (rolling batch)")
    tgi_compat: bool = Field(False, description="TGI-shaped bodies and errors on the LMI routes (rolling batch)")
    reasoning_parser: ReasoningParser = Field(
        "auto",
        description="chat: the reasoning returned as `reasoning_content` (`auto`: gpt-oss channels or `<think>` "
                    "markers, as the chat template or vocabulary shows; `deepseek_r1`/`qwen3`: `<think>` markers; "
                    "`openai_gptoss`: gpt-oss's analysis channel; `granite`: Granite 3.2's phrases; `gemma4`: "
                    "Gemma 4's thought channel; `mistral`: Magistral's `[THINK]`; `none`: off)",
    )
    max_reasoning_tokens: int | None = Field(
        None, ge=1,
        description="chat: most tokens in a reasoning block (the markers must be tokens); a request's "
                    "`thinking_token_budget` may lower it",
        json_schema_extra={"doc_default": "unbounded"},
    )
    tool_call_parser: ToolCallParser | None = Field(
        None,
        description="the format chat models write tool calls in (vLLM's parser names; see the OpenAI page)",
        json_schema_extra={"doc_default": "from the chat template, else `hermes`"},
    )
    chat_template: str | None = Field(
        None,
        description="the chat template every route renders messages with, instead of the checkpoint's: a file "
                    "(relative: in the model folder, else the working directory) or the Jinja text itself (a "
                    "value with `{`, `}` or a line break); a file that is not there is a start-up error",
        json_schema_extra={"doc_default": "the checkpoint's"},
    )
    trust_request_chat_template: bool = Field(
        False,
        description="honour a chat request's own `chat_template` (vLLM's `--trust-request-chat-template`); "
                    "off, such a request is a 400. The client's Jinja then runs in transformers' sandbox",
    )
    limit_mm_per_prompt: int = Field(
        4, ge=0,
        description="vision-language models: most images per chat request (`4` or LMI's `image=4`); more is a 400",
    )
    image_fetch: Literal["off", "public", "any"] = Field(
        "off",
        description="vision-language models: fetch http(s) image URLs: `off` (data URIs only), `public` (no "
                    "private, loopback or link-local address), `any` (an in-cluster image store too)",
    )
    image_fetch_timeout: float = Field(
        10.0, gt=0, le=300,
        description="vision-language models: seconds one image URL may take to download (connect and read)",
    )

    @field_validator("reasoning_parser", "tool_call_parser", mode="before")
    @classmethod
    def _request_choice(cls, value: Any, info: Any) -> Any:
        return choice(value, _CHOICES[info.field_name])

    @field_validator("tgi_compat", "trust_request_chat_template", mode="before")
    @classmethod
    def _request_flag(cls, value: Any) -> bool:
        return parse_bool(value)

    @field_validator("enable_streaming", mode="before")
    @classmethod
    def _streaming(cls, value: Any) -> bool:
        return parse_bool(value, also_true=("huggingface",))  # LMI's legacy spelling of "true"

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None, info: Any) -> str | None:
        """Inline text as given; a file name as its absolute path, which must exist (config/chat_template.py).
        `model_dir` (model_options) is validated before this field, so `info.data` holds it."""
        return None if value is None else chat_template.resolve(value, info.data.get("model_dir"))

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _images_limit(cls, value: Any) -> Any:
        """LMI / vLLM write it per modality (`image=4`, or JSON `{"image": 4}`); only images are served."""
        spelled = text(value).strip().strip("{}").replace('"', "").replace(":", "=")
        if "=" not in spelled:
            return value
        limits = dict(item.split("=", 1) for item in spelled.split(",") if item.strip())
        limits = {k.strip(): v.strip() for k, v in limits.items()}
        if set(limits) - {"image"}:
            raise ValueError(f"names {', '.join(sorted(set(limits) - {'image'}))}: only `image` inputs are served")
        return limits.get("image", 4)
