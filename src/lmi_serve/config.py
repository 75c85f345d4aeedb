"""Configuration: ``serving.properties`` + environment -> validated, immutable pydantic objects.

This runs in the launcher before torch/transformers are imported, so it uses only pydantic and
the stdlib. Every failure is a :class:`ConfigError` whose message starts with the key the user
actually wrote (``option.dtype`` from a file, ``OPTION_DTYPE`` from the environment): a container
that dies at startup is only debuggable when the message points at the knob to turn.

Precedence for one model: ``serving.properties`` beats the environment, which only fills what the
file left unset (LMI's ``putIfAbsent``). ``OPTION_<KEY>`` maps to ``option.<key>`` lower-cased
(``OPTION_ENTRYPOINT`` -> ``entryPoint``). Blank values count as unset everywhere. Among environment
names for one field the first one present wins:

======================  ==========================================================================
field                   environment names, highest first
======================  ==========================================================================
model_id                OPTION_MODEL_ID, HF_MODEL_ID
revision                OPTION_REVISION, HF_REVISION
task                    OPTION_TASK, HF_TASK
tensor_parallel_degree  OPTION_TENSOR_PARALLEL_DEGREE, TENSOR_PARALLEL_DEGREE, SM_NUM_GPUS
max_rolling_batch_size  OPTION_MAX_ROLLING_BATCH_SIZE, MAX_BATCH_SIZE
max_rolling_batch_prefill_tokens  OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS, MAX_BATCH_PREFILL_TOKENS
watermark_gamma         OPTION_WATERMARK_GAMMA, WATERMARK_GAMMA
watermark_delta         OPTION_WATERMARK_DELTA, WATERMARK_DELTA
trust_remote_code       OPTION_TRUST_REMOTE_CODE, HF_MODEL_TRUST_REMOTE_CODE
batch_size              OPTION_BATCH_SIZE, OPTION_MAX_DYNAMIC_BATCH_SIZE, SERVING_BATCH_SIZE
max_batch_delay         OPTION_MAX_BATCH_DELAY, SERVING_MAX_BATCH_DELAY
job_queue_size          OPTION_JOB_QUEUE_SIZE, SERVING_JOB_QUEUE_SIZE, MAX_CONCURRENT_REQUESTS
min_workers             OPTION_MIN_WORKERS, SERVING_MIN_WORKERS
max_workers             OPTION_MAX_WORKERS, SERVING_MAX_WORKERS
entry_point             OPTION_ENTRY_POINT, OPTION_ENTRYPOINT, DJL_ENTRY_POINT
predict_timeout         OPTION_PREDICT_TIMEOUT, PREDICT_TIMEOUT, SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS
model_loading_timeout   OPTION_MODEL_LOADING_TIMEOUT, MODEL_LOADING_TIMEOUT, SAGEMAKER_STARTUP_TIMEOUT
name                    OPTION_MODEL_NAME
(any other field)       OPTION_<FIELD>
======================  ==========================================================================

Server level (no file equivalent; CLI arguments win): port <- SAGEMAKER_BIND_TO_PORT, SERVING_PORT,
PORT (SAGEMAKER_BIND_TO_PORT also means host 0.0.0.0 unless a host was given); workers <-
SAGEMAKER_NUM_MODEL_WORKERS, SERVING_MAX_WORKERS; max_request_size <- option.max_request_bytes
(below), SAGEMAKER_MAX_REQUEST_SIZE (bytes), SAGEMAKER_MAX_PAYLOAD_IN_MB (MiB); threads <- SERVING_THREADS; cache_dir <-
LMI_SERVE_CACHE_DIR; graceful_timeout <- SERVING_GRACEFUL_TIMEOUT (seconds a SIGTERM leaves in-flight
requests to finish, drain.py).

Server-wide ``option.*`` keys (access control, security.py; ``option.max_request_bytes``) are read
from the models' options (serving.properties, else ``OPTION_<KEY>``), else ``LMI_SERVE_<KEY>``;
models that set one must agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .security import OPTION_KEYS as _SECURITY_KEYS
from .security import SecurityConfig, SecurityError, build_security, server_option

__all__ = ["ConfigError", "ModelConfig", "ServerConfig", "build_server_config", "load_model_config",
           "read_properties"]

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
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)
#: Where SageMaker mounts the model artefacts; a module constant so tests can point it elsewhere.
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
DEFAULT_MAX_REQUEST_SIZE = 64 * 1024 * 1024


class ConfigError(ValueError):
    """Invalid or missing configuration; the message starts with the offending key."""


class _FieldError(ValueError):
    """A cross-field failure that remembers which field to blame, so its source key can be named."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def read_properties(path: Path) -> dict[str, str]:
    """Parse the Java ``.properties`` subset LMI users write; a missing file is simply empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    props: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=len(line))
        key = line[:cut].strip()
        if key:
            props[key] = line[cut + 1:].strip()
    return props


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

    @field_validator("trust_remote_code", "tgi_compat", "enable_prefix_caching", "enable_lora", mode="before")
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
        for field, value in self.model_dump(exclude={"options", "unknown_options"}).items():
            if value is not None:
                props[field] = _text(value)
        return props

    @classmethod
    def from_handler_properties(cls, props: Mapping[str, str]) -> ModelConfig:
        """The inverse of :meth:`handler_properties`: DJL-style string properties validated back
        into a ModelConfig (keys that name no field stay in ``options``). For a built-in handler
        reached through DJL's first ``handle()`` call, e.g. from a user's model.py delegating to it.
        Without ``name`` (or DJL's ``model_name``) the model is called ``model``."""
        fields = set(cls.model_fields) - {"options", "unknown_options"}
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
            for field, value in model.model_dump(exclude={"name", "options", "unknown_options"}).items():
                lines.append(f"    {field} = {'-' if value is None else _text(value)}")
            shown = {k: "****" if _SECRET_KEY.search(k) else v for k, v in model.options.items()}
            lines.append(f"    options = {', '.join(f'{k}={v}' for k, v in sorted(shown.items())) or '-'}")
            if model.unknown_options:
                unknown = ", ".join(model.unknown_options)
                lines.append(f"    unknown options (custom handlers only) = {unknown}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, s: str) -> ServerConfig:
        return _validated(lambda: cls.model_validate_json(s), {}, {})


# --- merging sources --------------------------------------------------------------------------

_OPTION_FIELDS: dict[str, str] = {
    f: f for f in ModelConfig.model_fields if f not in ("name", "model_dir", "options", "unknown_options")
} | {"entryPoint": "entry_point", "max_dynamic_batch_size": "batch_size", "minWorkers": "min_workers",
     "maxWorkers": "max_workers", "model_name": "name"}
# "engine": accepted for LMI compatibility (there is one engine); the rest are server-wide options
# read from the models' options (security.py, and the body limit below)
_KNOWN_WITHOUT_FIELD = frozenset({"engine", *_SECURITY_KEYS, "max_request_bytes"})
#: serving.properties keys that LMI also accepts without the ``option.`` prefix
_BARE_KEYS = frozenset({"batch_size", "max_dynamic_batch_size", "max_batch_delay", "job_queue_size",
                        "minWorkers", "min_workers", "maxWorkers", "max_workers", "engine", "model_name"})
#: non-OPTION_* environment names per field, highest first (OPTION_* forms always beat these)
_ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "model_id": ("HF_MODEL_ID",),
    "revision": ("HF_REVISION",),
    "task": ("HF_TASK",),
    "tensor_parallel_degree": ("TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"),
    "max_rolling_batch_size": ("MAX_BATCH_SIZE",),
    "max_rolling_batch_prefill_tokens": ("MAX_BATCH_PREFILL_TOKENS",),
    "watermark_gamma": ("WATERMARK_GAMMA",),
    "watermark_delta": ("WATERMARK_DELTA",),
    "trust_remote_code": ("HF_MODEL_TRUST_REMOTE_CODE",),
    "batch_size": ("SERVING_BATCH_SIZE",),
    "max_batch_delay": ("SERVING_MAX_BATCH_DELAY",),
    "job_queue_size": ("SERVING_JOB_QUEUE_SIZE", "MAX_CONCURRENT_REQUESTS"),
    "min_workers": ("SERVING_MIN_WORKERS",),
    "max_workers": ("SERVING_MAX_WORKERS",),
    "entry_point": ("DJL_ENTRY_POINT",),
    "predict_timeout": ("PREDICT_TIMEOUT", "SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS"),
    "model_loading_timeout": ("MODEL_LOADING_TIMEOUT", "SAGEMAKER_STARTUP_TIMEOUT"),
}
_Layer = dict[str, tuple[str, str]]  # field -> (raw value, key as the user wrote it)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-blank value, as (name, stripped value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, str], _Layer]:
    options: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name, value in env.items():
        if name.startswith("OPTION_") and len(name) > len("OPTION_") and value.strip():
            key = "entryPoint" if name == "OPTION_ENTRYPOINT" else name[len("OPTION_"):].lower()
            options[key], sources[key] = value.strip(), name
    fields: _Layer = {}
    for key in sorted(options, key=lambda k: _OPTION_FIELDS.get(k) != k):  # canonical spelling first
        field = _OPTION_FIELDS.get(key)
        if field and field not in fields:
            fields[field] = (options[key], sources[key])
    for field, names in _ENV_ALIASES.items():
        hit = _first(env, *names)
        if field not in fields and hit:
            fields[field] = (hit[1], hit[0])
    return options, fields


def _properties_layer(props: Mapping[str, str]) -> tuple[dict[str, str], _Layer]:
    options: dict[str, str] = {}
    fields: _Layer = {}
    for key, value in props.items():  # file order: a later spelling of the same field wins
        if not value:
            continue
        if key.startswith("option."):
            short = key[len("option."):]
            options[short] = value
        elif key in _BARE_KEYS:
            short = key
            if key == "engine":
                options[key] = value
        else:
            continue  # LMI ignores unrelated keys too
        field = _OPTION_FIELDS.get(short)
        if field:
            fields[field] = (value, key)
    return options, fields


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def _is_model_folder(folder: Path) -> bool:
    return folder.is_dir() and (
        (folder / "serving.properties").is_file() or (folder / "model.py").is_file() or _has_weights(folder))


def _name_from_id(model_id: str) -> str:
    """``HuggingFaceTB/SmolLM2-135M-Instruct`` -> ``smollm2-135m-instruct``: a URL-safe route name."""
    tail = model_id.removeprefix("package:").rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tail).lower() or "model"


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


def load_model_config(model_dir: Path | None, env: Mapping[str, str],
                      name: str | None = None) -> ModelConfig:
    """Merge ``model_dir/serving.properties`` over ``env`` into one validated ModelConfig."""
    props: dict[str, str] = {}
    if model_dir is not None:
        model_dir = Path(os.path.abspath(model_dir))
        if not model_dir.is_dir():
            raise ConfigError(f"model_dir: {str(model_dir)!r} is not a directory")
        props = read_properties(model_dir / "serving.properties")
    env_options, fields = _env_layer(env)
    file_options, file_fields = _properties_layer(props)
    fields.update(file_fields)
    options = {**env_options, **file_options}
    values: dict[str, Any] = {f: raw for f, (raw, _) in fields.items()}
    keys = {f: key for f, (_, key) in fields.items()}

    if "model_id" not in values:
        if model_dir is not None and _has_weights(model_dir):
            values["model_id"], keys["model_id"] = str(model_dir), "model_dir"
        elif "entry_point" not in values and not (model_dir and (model_dir / "model.py").is_file()):
            where = f"{model_dir} holds no config.json, *.gguf or model.py" if model_dir else "no model dir"
            raise ConfigError(f"option.model_id: not set and {where} (set option.model_id or HF_MODEL_ID)")
    if name is not None:
        values["name"], keys["name"] = name, "name"
    elif "name" not in values:
        values["name"] = model_dir.name if model_dir else _name_from_id(values.get("model_id") or "model")
        keys["name"] = "model_dir" if model_dir else keys.get("model_id", "name")

    unknown = tuple(sorted(k for k in options if k not in _OPTION_FIELDS and k not in _KNOWN_WITHOUT_FIELD))
    data = {**values, "model_dir": str(model_dir) if model_dir else None,
            "options": options, "unknown_options": unknown}
    return _validated(lambda: ModelConfig.model_validate(data), values, keys, lambda f: f"option.{f}")


def _load_store(store: Path, env: Mapping[str, str]) -> tuple[ModelConfig, ...]:
    if not store.is_dir():
        raise ConfigError(f"model_store: {str(store)!r} is not a directory")
    folders = sorted((d for d in store.iterdir() if not d.name.startswith(".") and _is_model_folder(d)),
                     key=lambda d: d.name)
    if not folders:
        raise ConfigError(f"model_store: {str(store)!r} holds no model folder "
                          "(a subfolder with serving.properties, model.py, config.json or *.gguf)")
    models = []
    for folder in folders:
        try:
            models.append(load_model_config(folder, env, name=folder.name))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (model folder {folder})") from None
    return tuple(models)


def _discover_models(env: Mapping[str, str], model_dir: Path | None, model_store: Path | None,
                     default_store: Path | None) -> tuple[ModelConfig, ...]:
    if model_dir is not None:
        return (load_model_config(Path(model_dir), env),)
    if model_store is not None:
        return _load_store(Path(model_store), env)
    if _first(env, "HF_MODEL_ID"):
        return (load_model_config(None, env),)
    if _is_model_folder(SAGEMAKER_MODEL_DIR):
        return (load_model_config(SAGEMAKER_MODEL_DIR, env),)
    if _first(env, "OPTION_MODEL_ID"):
        return (load_model_config(None, env),)
    if default_store is not None:
        return _load_store(Path(default_store), env)
    raise ConfigError("HF_MODEL_ID: no model to serve; set HF_MODEL_ID or OPTION_MODEL_ID, "
                      "or give a model directory or model store")


def _expand_home(path: str, env: Mapping[str, str]) -> str:
    if path == "~" or path.startswith("~/"):
        return (env.get("HOME") or os.path.expanduser("~")) + path[1:]
    return os.path.expanduser(path)


def build_server_config(env: Mapping[str, str], *, model_dir: Path | None = None,
                        model_store: Path | None = None, host: str | None = None,
                        port: int | None = None, default_store: Path | None = None) -> ServerConfig:
    """Resolve the models to serve and the server settings; the launcher's single entry point."""
    values: dict[str, Any] = {"models": _discover_models(env, model_dir, model_store, default_store)}
    keys: dict[str, str] = {}

    def take(field: str, *names: str) -> None:
        hit = _first(env, *names)
        if hit:
            keys[field], values[field] = hit

    if port is not None:
        values["port"], keys["port"] = port, "port"
    else:
        take("port", "SAGEMAKER_BIND_TO_PORT", "SERVING_PORT", "PORT")
    if host is not None:
        values["host"], keys["host"] = host, "host"
    elif _first(env, "SAGEMAKER_BIND_TO_PORT"):
        values["host"], keys["host"] = "0.0.0.0", "SAGEMAKER_BIND_TO_PORT"
    take("workers", "SAGEMAKER_NUM_MODEL_WORKERS", "SERVING_MAX_WORKERS")
    take("threads", "SERVING_THREADS")
    _take_server_options(values, keys, env)
    if "max_request_size" not in values:
        take("max_request_size", "SAGEMAKER_MAX_REQUEST_SIZE")
    mib = _first(env, "SAGEMAKER_MAX_PAYLOAD_IN_MB")
    if "max_request_size" not in values and mib:
        try:
            values["max_request_size"] = int(mib[1]) * 1024 * 1024
        except ValueError:
            raise ConfigError(f"{mib[0]}: {mib[1]!r} is not an integer (MiB)") from None
        keys["max_request_size"] = mib[0]
    cache_dir = env.get("LMI_SERVE_CACHE_DIR", "").strip() or "~/.cache/lmi-serve"
    values["cache_dir"] = _expand_home(cache_dir, env)
    take("triton_server_name", "LMI_SERVE_TRITON_SERVER_NAME")
    take("strict_model_names", "LMI_SERVE_STRICT_MODEL_NAMES")
    take("graceful_timeout", "SERVING_GRACEFUL_TIMEOUT")
    return _validated(lambda: ServerConfig.model_validate(values), values, keys)


# --- server-wide options in serving.properties (security.py) -------------------------------------

def _take_server_options(values: dict[str, Any], keys: dict[str, str], env: Mapping[str, str]) -> None:
    """The server-wide `option.*` keys (the models' options, else LMI_SERVE_*): the access-control
    block and `option.max_request_bytes` (the body limit; it beats SageMaker's variables)."""
    model_options = [(m.name, m.options) for m in values["models"]]
    try:
        values["security"] = build_security(env, model_options)
        limit = server_option("max_request_bytes", env, model_options)
    except SecurityError as exc:
        raise ConfigError(str(exc)) from None
    if limit:
        values["max_request_size"], keys["max_request_size"] = limit
    # Keys stay out of what handlers receive (handler_properties) once they are digested here.
    values["models"] = tuple(m.model_copy(update={"options": {k: v for k, v in m.options.items()
                                                               if k not in _SECURITY_KEYS}})
                             for m in values["models"])
