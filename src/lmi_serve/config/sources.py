"""Configuration: ``serving.properties`` + environment -> validated, immutable pydantic objects.

This runs in the launcher before torch/transformers are imported, so it uses only pydantic and
the stdlib. Every failure is a :class:`ConfigError` whose message starts with the key the user
actually wrote (``option.dtype`` from a file, ``OPTION_DTYPE`` from the environment): a container
that dies at startup is only debuggable when the message points at the knob to turn. The objects
themselves and their rules are in config/models.py; this module reads the sources and re-exports them.

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
generation_deadline     OPTION_GENERATION_DEADLINE; unset: 55 on SageMaker endpoints (sagemaker.py)
(any other field)       OPTION_<FIELD>
======================  ==========================================================================

Server level (no file equivalent; CLI arguments win): port <- SAGEMAKER_BIND_TO_PORT, SERVING_PORT,
PORT (SAGEMAKER_BIND_TO_PORT also means host 0.0.0.0 unless a host was given); workers <-
SAGEMAKER_NUM_MODEL_WORKERS, SERVING_MAX_WORKERS; max_request_size <- option.max_request_bytes
(below), SAGEMAKER_MAX_REQUEST_SIZE (bytes), SAGEMAKER_MAX_PAYLOAD_IN_MB (MiB); threads <- SERVING_THREADS; cache_dir <-
LMI_SERVE_CACHE_DIR; graceful_timeout <- SERVING_GRACEFUL_TIMEOUT (seconds a SIGTERM leaves in-flight
requests to finish, drain.py); otlp_traces_endpoint <- option.otlp_traces_endpoint (below), then
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (tracing, server/tracing.py).

Server-wide ``option.*`` keys (access control, security.py; ``option.max_request_bytes``;
``option.cpu_threads``, cpu_budget.py; ``option.engine_replicas``, server/cpu_replicas.py; ``option.otlp_traces_endpoint``) are read from the models' options (serving.properties, else
``OPTION_<KEY>``), else ``LMI_SERVE_<KEY>``; models that set one must agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmi_serve.config.models import (
    KIND_NAMES, NOT_TAKEN, ConfigError, ModelConfig, ServerConfig, _validated, options_not_taken,
    tensor_parallel_conflict,
)
from lmi_serve.config.sagemaker import default_generation_deadline
from lmi_serve.config.security import OPTION_KEYS as _SECURITY_KEYS
from lmi_serve.config.sizes import parse_bytes
from lmi_serve.config.security import SecurityError, build_security, server_option

__all__ = ["KIND_NAMES", "ConfigError", "ModelConfig", "ServerConfig", "build_server_config", "load_model_config",
           "options_not_taken", "read_properties", "tensor_parallel_conflict"]

#: Where SageMaker mounts the model artefacts; a module constant so tests can point it elsewhere.
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")


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


# --- merging sources --------------------------------------------------------------------------

_OPTION_FIELDS: dict[str, str] = {
    f: f for f in ModelConfig.model_fields if f not in ("name", "model_dir", "options", "unknown_options")
} | {"entryPoint": "entry_point", "max_dynamic_batch_size": "batch_size", "minWorkers": "min_workers",
     "maxWorkers": "max_workers", "model_name": "name"}
# "engine": accepted for LMI compatibility (there is one engine); the rest are server-wide options
# read from the models' options (security.py, and the body limit below)
# Server-wide options of multi-model endpoints (serving/multi_model.py): the models' options may name them
_MME_KEYS = frozenset({"multi_model", "mme_memory_limit", "model_url_root"})
_KNOWN_WITHOUT_FIELD = frozenset({"engine", *_SECURITY_KEYS, "max_request_bytes", "cpu_threads", "engine_replicas",
                                  "otlp_traces_endpoint", *_MME_KEYS})
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


def load_model_config(model_dir: Path | None, env: Mapping[str, str],
                      name: str | None = None, *, one_of_many: bool = False) -> ModelConfig:
    """Merge ``model_dir/serving.properties`` over ``env`` into one validated ModelConfig.
    `one_of_many`: a model of a store serving several, where `OPTION_*` variables reach every
    model, so one its kind does not take is left out (`_leave_out_not_taken`)."""
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

    if "generation_deadline" not in values:  # SageMaker's real-time endpoints answer within 60 s
        deadline = default_generation_deadline(env)
        if deadline is not None:
            values["generation_deadline"], keys["generation_deadline"] = deadline
    ignored = _leave_out_not_taken(values, keys, options, file_fields) if one_of_many else ()
    unknown = tuple(sorted(k for k in options if k not in _OPTION_FIELDS and k not in _KNOWN_WITHOUT_FIELD))
    data = {**values, "model_dir": str(model_dir) if model_dir else None,
            "options": options, "unknown_options": unknown, "ignored_options": ignored}
    return _validated(lambda: ModelConfig.model_validate(data), values, keys, lambda f: f"option.{f}")


def _leave_out_not_taken(values: dict[str, Any], keys: dict[str, str], options: dict[str, str],
                         file_fields: _Layer) -> tuple[str, ...]:
    """Drop from `values` and `options` each option the model's declared kind does not take
    (NOT_TAKEN) that only the environment set; return the variables dropped. One the model's own
    serving.properties sets stays, and is refused by name when the model is validated."""
    task = str(values.get("task") or "").strip().lower()
    dropped = []
    for field in NOT_TAKEN.get(task, {}):
        if field in values and field not in file_fields:
            dropped.append(keys.pop(field))
            del values[field]
            for key in [k for k in options if _OPTION_FIELDS.get(k) == field]:
                del options[key]
    return tuple(dropped)


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
            models.append(load_model_config(folder, env, name=folder.name, one_of_many=len(folders) > 1))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (model folder {folder})") from None
    return tuple(models)


def _discover_models(env: Mapping[str, str], model_dir: Path | None, model_store: Path | None,
                     default_store: Path | None, multi_model: bool = False) -> tuple[ModelConfig, ...]:
    if model_dir is not None:
        return (load_model_config(Path(model_dir), env),)
    if model_store is not None:
        return _load_store(Path(model_store), env)
    if _first(env, "HF_MODEL_ID"):
        return (load_model_config(None, env),)
    if multi_model:  # SageMaker starts a multi-model container empty, then loads models through POST /models
        return ()
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
    multi_model = _multi_model(env)
    values: dict[str, Any] = {"models": _discover_models(env, model_dir, model_store, default_store,
                                                         multi_model is not None and multi_model[1])}
    keys: dict[str, str] = {}
    if multi_model is not None:
        keys["multi_model"], values["multi_model"] = multi_model
    _take_mme_options(values, keys, env)

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


# --- multi-model endpoints (serving/multi_model.py) ---------------------------------------------------

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off", ""}


def _multi_model(env: Mapping[str, str]) -> tuple[str, bool] | None:
    """(the variable, whether on) from SAGEMAKER_MULTI_MODEL (what SageMaker's containers read),
    OPTION_MULTI_MODEL or LMI_SERVE_MULTI_MODEL; None when none is set."""
    hit = _first(env, "SAGEMAKER_MULTI_MODEL", "OPTION_MULTI_MODEL", "LMI_SERVE_MULTI_MODEL")
    if hit is None:
        return None
    text = hit[1].strip().lower()
    if text not in _TRUE | _FALSE:
        raise ConfigError(f"{hit[0]}: {hit[1]!r} is not true or false")
    return hit[0], text in _TRUE


def _take_mme_options(values: dict[str, Any], keys: dict[str, str], env: Mapping[str, str]) -> None:
    """option.mme_memory_limit (a size: 4GiB, 512MiB, bytes) and option.model_url_root, from the
    environment (OPTION_* or LMI_SERVE_*): a multi-model container may start with no model to carry them."""
    limit = _first(env, "OPTION_MME_MEMORY_LIMIT", "LMI_SERVE_MME_MEMORY_LIMIT")
    if limit:
        try:
            values["mme_memory_limit"] = parse_bytes(limit[1])
        except ValueError as exc:
            raise ConfigError(f"{limit[0]}: {exc}") from None
        keys["mme_memory_limit"] = limit[0]
    root = _first(env, "OPTION_MODEL_URL_ROOT", "LMI_SERVE_MODEL_URL_ROOT")
    if root:
        keys["model_url_root"], values["model_url_root"] = root[0], os.path.abspath(root[1])


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
    # The thread budget (cpu_budget.py) and the engine replicas (server/cpu_replicas.py); OPTION_* also where
    # a multi-model endpoint starts with no model
    for key in ("cpu_threads", "engine_replicas"):
        found, bare = server_option(key, env, model_options), _first(env, f"OPTION_{key.upper()}")
        if found or bare:
            values[key], keys[key] = found or (bare[1], bare[0])
    # OpenTelemetry traces (server/tracing.py): our option first, then OpenTelemetry's own variable
    otel = _first(env, "OPTION_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    endpoint = server_option("otlp_traces_endpoint", env, model_options) or (otel and (otel[1], otel[0]))
    if endpoint:
        values["otlp_traces_endpoint"], keys["otlp_traces_endpoint"] = endpoint
    # Keys stay out of what handlers receive (handler_properties) once they are digested here.
    values["models"] = tuple(m.model_copy(update={"options": {k: v for k, v in m.options.items()
                                                               if k not in _SECURITY_KEYS}})
                             for m in values["models"])
