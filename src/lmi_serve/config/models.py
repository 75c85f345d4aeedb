"""The validated configuration objects: one `ModelConfig` per served model and the `ServerConfig`
around them, immutable, with the choices and cross-field rules every value must meet.

`ModelConfig` is assembled here from one class of options per concern, each in its own module:
model_options (the model, its weights, its handler), engine_options (batching, scheduling, KV cache,
speculation), kernel_options (which kernels the layers run on), adapter_options (LoRA), request_options
(what requests carry, how answers are shaped) and server_options (timeouts and limits). The rules that
cross concerns, and the names other modules import, stay here.

Where the values come from (serving.properties, `OPTION_*` and the other environment variables,
the model store, SageMaker's mount) is config/sources.py's business; it builds these and re-exports them,
so the rest of the code imports everything from `config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmi_serve.config.adapter_options import AdapterOptions, LoraDtype
from lmi_serve.config.engine_options import (
    DEFAULT_KV_CACHE, DEFAULT_SPEC_LENGTH, EngineOptions, KvCache, RollingBatch,
)
from lmi_serve.config.fields import ConfigError, FieldError
from lmi_serve.config.fields import text as _text
from lmi_serve.config.kernel_options import DecodeAttention, KernelOptions, LinearKernel, Quantize, RowKernel
from lmi_serve.config.model_options import Dtype, ModelOptions, Task
from lmi_serve.config.request_options import ReasoningParser, RequestOptions, ToolCallParser
from lmi_serve.config.security import SecurityConfig
from lmi_serve.config.server_options import ServerOptions

__all__ = ["DEFAULT_KV_CACHE", "DEFAULT_MAX_REQUEST_SIZE", "DEFAULT_SPEC_LENGTH", "KIND_NAMES", "NOT_TAKEN",
           "ConfigError", "DecodeAttention", "Dtype", "KvCache", "LinearKernel", "LoraDtype", "ModelConfig",
           "Quantize", "ReasoningParser", "RollingBatch", "RowKernel", "ServerConfig", "Task", "ToolCallParser",
           "options_not_taken", "tensor_parallel_conflict"]

# What each kind of model cannot honour: field -> why. The one declaration of it: config/sources.py refuses
# such an option, naming it, when the user set it for that model, and ignores it (with a log line)
# when an OPTION_* variable set it for every model of a store; a handler refuses it for a model
# whose kind is only decided at load (options_not_taken).
NOT_TAKEN: dict[str, dict[str, str]] = {
    "text-generation": {},
    "text2text-generation": {
        "enable_prefix_caching": "an encoder-decoder model's KV cache cannot start a row from a cached prefix",
        "enable_lora": "LoRA adapters are served on decoder-only models",
        "draft_model_id": "an encoder-decoder model's KV cache cannot verify draft tokens",
    },
    "text-embedding": {"quantize": "text generation only", "quantize_lm_head": "text generation only",
                       "enable_prefix_caching": "text generation only",
                       "chat_template": "text generation only",
                       "trust_request_chat_template": "text generation only",
                       "draft_model_id": "text generation only", "decode_attention": "text generation only",
                       "mixed_steps": "text generation only", "row_kernel": "text generation only"},
    "text-classification": {"quantize": "text generation only", "quantize_lm_head": "text generation only",
                            "enable_prefix_caching": "text generation only",
                            "chat_template": "text generation only",
                            "trust_request_chat_template": "text generation only",
                            "draft_model_id": "text generation only", "decode_attention": "text generation only",
                            "mixed_steps": "text generation only", "row_kernel": "text generation only"},
    "tensor": {},
}
KIND_NAMES = {"text2text-generation": "encoder-decoder", "text-embedding": "embedding",
              "text-classification": "classification"}  # in messages
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)
DEFAULT_MAX_REQUEST_SIZE = 64 * 1024 * 1024


def options_not_taken(config: "ModelConfig", task: str) -> list[tuple[str, str]]:
    """(field, "not available for <kind> models (why)") for each option `config` sets that a
    `task` model does not take (NOT_TAKEN)."""
    return [(field, f"not available for {KIND_NAMES.get(task, task)} models ({why})")
            for field, why in NOT_TAKEN.get(task, {}).items()
            if getattr(config, field) != ModelConfig.model_fields[field].default]


def tensor_parallel_conflict(config: "ModelConfig", degree: int) -> str | None:
    """Why `config` cannot run sharded over `degree` ranks (model/tp.py), or None. The followers replay
    only the KV cache's model calls (engine/kv/replicate.py): what rewrites or reads rank 0's layers or
    K/V alone cannot follow. `max` is checked once the server knows how many ranks it means."""
    if degree <= 1:
        return None
    refused = [("option.device_map", config.device_map is not None),
               ("option.enable_prefix_caching", config.enable_prefix_caching),
               ("option.enable_lora", config.enable_lora),
               ("option.draft_model_id", config.draft_model_id is not None),
               (f"option.quantize={config.quantize}", config.quantize != "none"),
               ("option.linear_kernel=onednn", config.linear_kernel == "onednn"),
               ("option.row_kernel=on", config.row_kernel == "on"),
               ("option.rolling_batch=disable", config.rolling_batch == "disable")]
    names = [name for name, on in refused if on]
    if not names:
        return None
    return (f"tensor_parallel_degree={degree} cannot be combined with {', '.join(names)} (tensor parallelism "
            "replays only the KV cache's model calls on the other ranks); use tensor_parallel_degree=1 for them")


# pydantic orders the fields from the last base to the first, so the concerns are listed in reverse: the
# option table (config/doc.py) and the start-up log read model, engine, kernels, adapters, requests, server,
# and `model_dir` is validated before request_options' `chat_template`, which resolves a file against it.
class ModelConfig(ServerOptions, RequestOptions, AdapterOptions, KernelOptions, EngineOptions, ModelOptions):
    """One served model, fully resolved; immutable so workers can share it without surprises."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    options: dict[str, str] = Field(default_factory=dict)
    unknown_options: tuple[str, ...] = ()
    # OPTION_* variables left out for this model: its kind does not take them (NOT_TAKEN)
    ignored_options: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _cross_field(self) -> ModelConfig:
        for field, reason in options_not_taken(self, self.task) if self.task else ():
            raise FieldError(field, reason)
        if self.enable_streaming and self.batch_size > 1:
            raise FieldError("enable_streaming", "We cannot enable streaming for dynamic batching "
                             f"(batch_size is {self.batch_size}; set it to 1 or disable streaming)")
        if self.enable_prefix_caching and self.rolling_batch == "disable":
            raise FieldError("enable_prefix_caching", "prefix caching needs the rolling batch; "
                             "this model has option.rolling_batch=disable")
        if self.enable_lora and self.rolling_batch == "disable":
            raise FieldError("enable_lora", "LoRA adapters need the rolling batch; "
                             "this model has option.rolling_batch=disable")
        self._check_speculation()
        if self.quantize == "q4" and self.dtype == "fp16":
            raise FieldError("quantize", "option.quantize=q4 computes in fp32 or bf16 (the int4 kernel's fast "
                             "path); option.dtype=fp16 cannot be combined with it (use bf16, fp32 or auto)")
        if self.quantize_lm_head and self.quantize != "q4":
            raise FieldError("quantize_lm_head", "option.quantize_lm_head rounds the lm_head to int8 beside a "
                             f"checkpoint's own quantized layers: it needs option.quantize=q4 (this model has "
                             f"{self.quantize})")
        if self.quantize == "fp16" and self.dtype in ("fp16", "bf16"):
            raise FieldError("quantize", f"option.quantize={self.quantize} computes in fp32 from fp32-loaded "
                             f"weights; option.dtype={self.dtype} cannot be combined with it (use fp32 or auto)")
        degree = self.tensor_parallel_degree
        conflict = tensor_parallel_conflict(self, degree) if isinstance(degree, int) else None
        if conflict:
            raise FieldError("tensor_parallel_degree", conflict)
        if self.max_workers < self.min_workers:
            raise FieldError("max_workers", f"max_workers ({self.max_workers}) is less than "
                             f"min_workers ({self.min_workers})")
        return self

    def _check_speculation(self) -> None:
        if self.draft_model_id is None:
            if self.spec_length:
                raise FieldError("spec_length", "draft tokens need option.draft_model_id=ngram")
            return
        if self.rolling_batch == "disable":
            raise FieldError("draft_model_id", "speculation needs the rolling batch; "
                             "this model has option.rolling_batch=disable")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise FieldError("prompt_lookup_min", f"option.prompt_lookup_min ({self.prompt_lookup_min}) is more "
                             f"than option.prompt_lookup_max ({self.prompt_lookup_max})")

    def handler_properties(self) -> dict[str, str]:
        """DJL-style init properties: raw options overlaid with every resolved (typed) value."""
        props = dict(self.options)
        for field, value in self.model_dump(exclude={"options", "unknown_options", "ignored_options"}).items():
            if value is not None:
                props[field] = _text(value)
        return props

    @classmethod
    def from_handler_properties(cls, props: Mapping[str, str]) -> ModelConfig:
        """The inverse of :meth:`handler_properties`: DJL-style string properties validated back
        into a ModelConfig (keys that name no field stay in ``options``). For a built-in handler
        reached through DJL's first ``handle()`` call, e.g. from a user's model.py delegating to it.
        Without ``name`` (or DJL's ``model_name``) the model is called ``model``."""
        fields = set(cls.model_fields) - {"options", "unknown_options", "ignored_options"}
        values: dict[str, Any] = {k: v for k, v in props.items() if k in fields and v not in (None, "")}
        values.setdefault("name", props.get("model_name") or "model")
        values["options"] = {k: str(v) for k, v in props.items() if k not in fields}
        return _validated(lambda: cls.model_validate(values), values, {})


class ServerConfig(BaseModel):
    """Process-wide settings plus every model; serialised to JSON for the worker processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    workers: int = Field(1, ge=1)
    threads: int = Field(64, ge=1)
    max_request_size: int = Field(DEFAULT_MAX_REQUEST_SIZE, ge=1)
    request_id_header: str = "x-request-id"
    cache_dir: str = Field(default_factory=lambda: os.path.expanduser("~/.cache/lmi-serve"))
    triton_server_name: str = Field("triton", min_length=1)  # GET /v2 "name" (Triton's scripts check it)
    # OpenAI routes: an unknown `model` is a 404 even when one text-generation model is served (vLLM)
    strict_model_names: bool = False
    # SIGTERM: seconds in-flight requests and streams get to finish before they end with an error (drain.py)
    graceful_timeout: float = Field(30.0, gt=0)
    # Access control (security.py): API keys (digests only), the management switch, the adapters root
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    # SageMaker multi-model endpoints (serving/multi_model.py): models loaded and unloaded at run time
    # through POST / DELETE /models; the store may start empty
    multi_model: bool = False
    mme_memory_limit: int | None = Field(None, ge=1)  # bytes the models may take; None: 85% of the container's
    model_url_root: str = "/opt/ml/models"  # the folder POST /models may load from (SageMaker's)
    # The server's CPU threads at most (option.cpu_threads; cpu_budget.py: the quota and affinity may lower it)
    cpu_threads: int | None = Field(None, ge=1)
    # Engine replicas pinned to their own cores (option.engine_replicas; server/cpu_replicas.py): a number,
    # "auto" (from the CPU budget), or None: the workers as set, unpinned
    engine_replicas: int | Literal["auto"] | None = None
    # OpenTelemetry traces (server/tracing.py): the OTLP/HTTP endpoint spans go to; None: no tracing
    otlp_traces_endpoint: str | None = None
    models: tuple[ModelConfig, ...] = ()

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("is not an http(s) URL: OTLP/HTTP's full traces URL, such as "
                                 "http://collector:4318/v1/traces")
        return url

    @field_validator("engine_replicas", mode="before")
    @classmethod
    def _replicas(cls, value: Any) -> Any:
        text = str(value).strip().lower() if value is not None else None
        if text is None or text == "auto":
            return text
        if not text.isdigit() or int(text) < 1:
            raise ValueError("is neither `auto` nor a number of replicas >= 1")
        return int(text)

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate model names: {', '.join(duplicates)}")
        return models

    @model_validator(mode="after")
    def _models_or_multi_model(self) -> ServerConfig:
        if not self.models and not self.multi_model:
            raise FieldError("models", "no model to serve (only a multi-model endpoint, SAGEMAKER_MULTI_MODEL=true, "
                                       "may start with none)")
        # Every worker process holds its own copy of every model, and a load or unload reaches the one
        # worker that answers it: with several, they would disagree on what is loaded. One worker with
        # torch's threads on every core already uses the CPU and batches across requests.
        if self.multi_model and self.workers > 1:
            raise FieldError("workers", f"a multi-model endpoint (SAGEMAKER_MULTI_MODEL) needs a single worker: a "
                                        f"model is loaded into the worker that answers POST /models, and workers is "
                                        f"{self.workers}")
        return self

    @model_validator(mode="after")
    def _one_worker_for_lora(self) -> ServerConfig:
        # The adapters API changes one process's adapters; several replicas would disagree on them.
        lora = [m.name for m in self.models if m.enable_lora]
        if lora and self.workers > 1:
            raise FieldError("workers", f"option.enable_lora (model {lora[0]}) needs a single worker: the adapters API "
                             f"registers an adapter in the worker that answers it, and workers is {self.workers}")
        return self

    def describe(self) -> str:
        """Every resolved value, one per line, for the single startup log record."""
        lines = ["lmi-serve configuration:"]
        lines += [f"  {k} = {v}" for k, v in self.model_dump(exclude={"models", "security"}).items()]
        lines += self.security.describe()
        for model in self.models:
            lines.append(f"  model {model.name!r}:")
            for field, value in model.model_dump(exclude={"name", "options", "unknown_options",
                                                          "ignored_options"}).items():
                lines.append(f"    {field} = {'-' if value is None else _text(value)}")
            shown = {k: "****" if _SECRET_KEY.search(k) else v for k, v in model.options.items()}
            lines.append(f"    options = {', '.join(f'{k}={v}' for k, v in sorted(shown.items())) or '-'}")
            if model.unknown_options:
                unknown = ", ".join(model.unknown_options)
                lines.append(f"    unknown options (custom handlers only) = {unknown}")
            if model.ignored_options:
                lines.append(f"    ignored (not for {KIND_NAMES.get(model.task or '', model.task)} models) = "
                             f"{', '.join(model.ignored_options)}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, s: str) -> ServerConfig:
        return _validated(lambda: cls.model_validate_json(s), {}, {})


_REASONS = {  # pydantic error type -> our wording (formatted with the error's ctx)
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}", "too_short": "must not be empty", "value_error": "{error}",
    "int_parsing": "is not an integer", "int_from_float": "is not an integer",
    "int_type": "is not an integer", "float_parsing": "is not a number", "float_type": "is not a number",
    "string_pattern_mismatch": "is not a valid name (use letters, digits, '_', '.', '-')",
}


def _validated(build: Callable[[], Any], raws: Mapping[str, Any], keys: Mapping[str, str],
               default_key: Callable[[str], str] = lambda field: field) -> Any:
    """Run a pydantic build, re-raising failures as ConfigError naming each source key."""
    try:
        return build()
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            ctx = err.get("ctx") or {}
            blamed = getattr(ctx.get("error"), "field", None)
            field = blamed or ".".join(str(p) for p in err["loc"])
            key = keys.get(field) or default_key(field)
            reason = _REASONS[err["type"]].format(**ctx) if err["type"] in _REASONS else err["msg"]
            if blamed or not err["loc"]:
                lines.append(f"{key}: {reason}")
            else:
                lines.append(f"{key}: {raws.get(field, err.get('input'))!r} {reason}")
        raise ConfigError("\n".join(lines)) from None
