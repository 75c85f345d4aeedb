"""The validated configuration objects: one `ModelConfig` per served model and the `ServerConfig`
around them, immutable, with the choices and cross-field rules every value must meet.

Where the values come from (serving.properties, `OPTION_*` and the other environment variables,
the model store, SageMaker's mount) is config.py's business; it builds these and re-exports them,
so the rest of the code imports everything from `config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .security import SecurityConfig

Dtype = Literal["fp32", "fp16", "bf16", "auto"]
RollingBatch = Literal["auto", "scheduler", "disable"]
# slots: preallocated buffers written in place (engine/kv_slots.py); dynamic: transformers' DynamicCache,
# concatenated every step (kv_dynamic.py), the baseline and a fallback. Encoder-decoders have their own.
KvCache = Literal["slots", "dynamic"]
# Opt-in lighter weights (model/quantize.py): none = the weights as loaded; fp16 = fp16-stored weights,
# fp32 compute; q4 = the GGUF's own 4-bit blocks (a Q4_0 / Q4_1 GGUF only). CPU only.
Quantize = Literal["none", "fp16", "q4"]
# fp32 Linear layers on the CPU (model/linear_kernels.py): auto = oneDNN's packed weights where they apply
# (fp32, CPU, torch built with oneDNN), else torch's; onednn = that or a start-up error; torch = nn.Linear (MKL).
LinearKernel = Literal["auto", "onednn", "torch"]
# The LoRA matrices' dtype (model/lora.py): auto = the model's.
LoraDtype = Literal["auto", "fp32", "fp16", "bf16"]
# text2text-generation: encoder-decoder models (T5, BART), served by the text-generation handler and routes.
# tensor: a model.py serving tensors (Triton).
Task = Literal["text-generation", "text2text-generation", "text-embedding", "tensor"]
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": get_args(Dtype), "rolling_batch": get_args(RollingBatch), "task": get_args(Task),
    "kv_cache": get_args(KvCache), "quantize": get_args(Quantize), "linear_kernel": get_args(LinearKernel),
    "lora_dtype": get_args(LoraDtype),
}
# What each kind of model cannot honour: field -> why. The one declaration of it: config.py refuses
# such an option, naming it, when the user set it for that model, and ignores it (with a log line)
# when an OPTION_* variable set it for every model of a store; a handler refuses it for a model
# whose kind is only decided at load (options_not_taken).
NOT_TAKEN: dict[str, dict[str, str]] = {
    "text-generation": {},
    "text2text-generation": {
        "enable_prefix_caching": "an encoder-decoder model's KV cache cannot start a row from a cached prefix",
        "enable_lora": "LoRA adapters are served on decoder-only models",
    },
    "text-embedding": {"quantize": "text generation only", "enable_prefix_caching": "text generation only"},
    "tensor": {},
}
KIND_NAMES = {"text2text-generation": "encoder-decoder", "text-embedding": "embedding"}  # in messages
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)
DEFAULT_MAX_REQUEST_SIZE = 64 * 1024 * 1024


class ConfigError(ValueError):
    """Invalid or missing configuration; the message starts with the offending key."""


class _FieldError(ValueError):
    """A cross-field failure that remembers which field to blame, so its source key can be named."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _parse_bool(value: Any, *, also_true: tuple[str, ...] = ()) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in also_true:
        return True
    if text in _FALSE:
        return False
    extra = "".join(f", {t}" for t in also_true)
    raise ValueError(f"is not a boolean (use true/false, 1/0, yes/no{extra})")


def _text(value: Any) -> str:
    """Render a resolved value the way a properties file would spell it."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def options_not_taken(config: "ModelConfig", task: str) -> list[tuple[str, str]]:
    """(field, "not available for <kind> models (why)") for each option `config` sets that a
    `task` model does not take (NOT_TAKEN)."""
    return [(field, f"not available for {KIND_NAMES.get(task, task)} models ({why})")
            for field, why in NOT_TAKEN.get(task, {}).items()
            if getattr(config, field) != ModelConfig.model_fields[field].default]


def tensor_parallel_conflict(config: "ModelConfig", degree: int) -> str | None:
    """Why `config` cannot run sharded over `degree` ranks (model/tp.py), or None. The followers replay
    only the KV cache's model calls (engine/replicate.py): what rewrites or reads rank 0's layers or
    K/V alone cannot follow. `max` is checked once the server knows how many ranks it means."""
    if degree <= 1:
        return None
    refused = [("option.device_map", config.device_map is not None),
               ("option.enable_prefix_caching", config.enable_prefix_caching),
               ("option.enable_lora", config.enable_lora),
               (f"option.quantize={config.quantize}", config.quantize != "none"),
               ("option.linear_kernel=onednn", config.linear_kernel == "onednn"),
               ("option.rolling_batch=disable", config.rolling_batch == "disable")]
    names = [name for name, on in refused if on]
    if not names:
        return None
    return (f"tensor_parallel_degree={degree} cannot be combined with {', '.join(names)} (tensor parallelism "
            "replays only the KV cache's model calls on the other ranks); use tensor_parallel_degree=1 for them")


class ModelConfig(BaseModel):
    """One served model, fully resolved; immutable so workers can share it without surprises."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    name: str = Field(pattern=_NAME_PATTERN)
    model_dir: str | None = None
    model_id: str | None = None
    gguf_file: str | None = None
    dtype: Dtype = "auto"
    device_map: str | None = None
    tensor_parallel_degree: int | Literal["max"] = 1
    trust_remote_code: bool = False
    revision: str | None = None
    # A Hub or S3 model with only *.bin / *.pt / *.pth / *.ckpt weights (unpickling runs code): refused unless set
    allow_pickled_weights: bool = False
    task: Task | None = None
    rolling_batch: RollingBatch = "auto"
    max_rolling_batch_size: int = Field(32, ge=1)
    max_rolling_batch_prefill_tokens: int = Field(512, ge=1)
    kv_cache: KvCache = "slots"
    # Prompts that share a prefix reuse its K/V (engine/prefix_cache.py), held within prefix_cache_mb.
    enable_prefix_caching: bool = False
    prefix_cache_mb: int = Field(512, ge=1)
    # TGI's watermark (engine/watermark.py): the green list's share of the vocabulary, and its bias
    watermark_gamma: float = Field(0.5, gt=0, lt=1)
    watermark_delta: float = Field(2.0, ge=0)
    quantize: Quantize = "none"
    linear_kernel: LinearKernel = "auto"
    # LoRA adapters (model/lora.py, engine/adapters.py): <model_dir>/adapters/* at start-up, the adapters API
    enable_lora: bool = False
    max_loras: int = Field(4, ge=1)  # adapters resident at once; more are reloaded from their folder on demand
    max_lora_rank: int = Field(64, ge=1)  # a larger adapter is refused at registration
    lora_dtype: LoraDtype = "auto"
    batch_size: int = Field(1, ge=1)
    max_batch_delay: int = Field(100, ge=0)
    enable_streaming: bool = False
    output_formatter: str | None = None
    tgi_compat: bool = False
    entry_point: str | None = None
    handler: str = "handle"
    predict_timeout: float = Field(120.0, gt=0)
    model_loading_timeout: float = Field(240.0, gt=0)
    job_queue_size: int = Field(1000, ge=1)
    max_input_len: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(1, ge=1)
    options: dict[str, str] = Field(default_factory=dict)
    unknown_options: tuple[str, ...] = ()
    # OPTION_* variables left out for this model: its kind does not take them (NOT_TAKEN)
    ignored_options: tuple[str, ...] = ()

    @field_validator("dtype", "rolling_batch", "task", "kv_cache", "quantize", "linear_kernel", "lora_dtype",
                     mode="before")
    @classmethod
    def _choice(cls, value: Any, info: Any) -> Any:
        if value is None:
            return None
        choices = _CHOICES[info.field_name]
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return text

    @field_validator("trust_remote_code", "tgi_compat", "enable_prefix_caching", "enable_lora", "allow_pickled_weights",
                     mode="before")
    @classmethod
    def _flag(cls, value: Any) -> bool:
        return _parse_bool(value)

    @field_validator("enable_streaming", mode="before")
    @classmethod
    def _streaming(cls, value: Any) -> bool:
        return _parse_bool(value, also_true=("huggingface",))  # LMI's legacy spelling of "true"

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _tp(cls, value: Any) -> int | str:
        text = str(value).strip().lower()
        if text in ("max", "-1"):
            return "max"
        try:
            degree = int(text)
        except ValueError:
            degree = 0
        if degree < 1:
            raise ValueError("must be an integer >= 1, 'max' or -1")
        return degree

    @model_validator(mode="after")
    def _cross_field(self) -> ModelConfig:
        for field, reason in options_not_taken(self, self.task) if self.task else ():
            raise _FieldError(field, reason)
        if self.enable_streaming and self.batch_size > 1:
            raise _FieldError("enable_streaming", "We cannot enable streaming for dynamic batching "
                              f"(batch_size is {self.batch_size}; set it to 1 or disable streaming)")
        if self.enable_prefix_caching and self.rolling_batch == "disable":
            raise _FieldError("enable_prefix_caching", "prefix caching needs the rolling batch; "
                              "this model has option.rolling_batch=disable")
        if self.enable_lora and self.rolling_batch == "disable":
            raise _FieldError("enable_lora", "LoRA adapters need the rolling batch; "
                              "this model has option.rolling_batch=disable")
        if self.quantize != "none" and self.dtype in ("fp16", "bf16"):
            raise _FieldError("quantize", f"option.quantize={self.quantize} computes in fp32 from fp32-loaded "
                              f"weights; option.dtype={self.dtype} cannot be combined with it (use fp32 or auto)")
        degree = self.tensor_parallel_degree
        conflict = tensor_parallel_conflict(self, degree) if isinstance(degree, int) else None
        if conflict:
            raise _FieldError("tensor_parallel_degree", conflict)
        if self.max_workers < self.min_workers:
            raise _FieldError("max_workers", f"max_workers ({self.max_workers}) is less than "
                              f"min_workers ({self.min_workers})")
        return self

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
    models: tuple[ModelConfig, ...] = Field(min_length=1)

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate model names: {', '.join(duplicates)}")
        return models

    @model_validator(mode="after")
    def _one_worker_for_lora(self) -> ServerConfig:
        # The adapters API changes one process's adapters; several replicas would disagree on them.
        lora = [m.name for m in self.models if m.enable_lora]
        if lora and self.workers > 1:
            raise _FieldError("workers", f"option.enable_lora (model {lora[0]}) needs a single worker: the adapters API "
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
