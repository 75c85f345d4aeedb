"""`lmi-serve` / `python -m lmi_serve`: validate the configuration, then run gunicorn.

The configuration is built and validated here, once, before any worker starts: a bad value
exits with status 2 and a message naming the key, so the server never becomes healthy.
Workers are gthread workers (a thread per connection, so a stream never pins a process) that
answer HTTP-layer errors in JSON (server/http_worker.py, set up by server/gunicorn_app.py); each worker process loads its own copy of
every model after the fork.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from lmi_serve.config.sources import KIND_NAMES, ConfigError, build_server_config
from lmi_serve.cpu_budget import cpu_budget
from lmi_serve.server import logs
from lmi_serve.server import security
from lmi_serve.server.cpu_replicas import affinity_cpus, plan_replicas
from lmi_serve.server.gpus import count_gpus, plan_gpus
from lmi_serve.server.gunicorn_app import run_gunicorn

log = logging.getLogger("lmi_serve")

DEFAULT_STORE = Path(__file__).resolve().parent / "serving" / "defaults"

# Set before transformers is imported anywhere. Hub ids and s3:// models are downloaded at start-up
# (model/download.py; HF_HUB_OFFLINE=1 from the user keeps it to the local cache); transformers is then
# given local folders only, so nothing reaches the network at load or run time.
_RUNTIME_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # download progress is logged as lines (model/download.py)
    # Every tqdm bar (transformers' GGUF conversion uses tqdm directly): a server's log is lines, and
    # with --log-format json each one must be a JSON object; the conversion is logged once instead.
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Two caches keep a compiled kernel per Linear shape and input row count, 1,024 entries each by
    # default: oneDNN's primitive cache and, holding its own references to them, ideep's (torch's oneDNN
    # layer, read by kernels/layers/linear_kernels.py's packed Linear). Under mixed prompt lengths every prefill
    # is a new row count, and the two together held ~290 MiB once full, reached only after tens of
    # minutes of traffic: the worker's RSS drift in scripts/soak (benchmarks/journal/2026-11.md, "Soak"). Re-creating a kernel
    # costs ~0.3-0.45 ms, a few per step whose batch size changed, against steps of tens of ms
    # (benchmarks/bench_kernel_cache.py measures both).
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    "LRU_CACHE_CAPACITY": "64",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lmi-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in the container)")
    parser.add_argument("--port", type=int, help="port to bind (default 8080)")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model-dir", type=Path, help="serve the one model in this folder")
    models.add_argument("--model-store", type=Path, help="serve every model folder inside this folder")
    parser.add_argument("--workers", type=int, help="model replicas (processes); default SAGEMAKER_NUM_MODEL_WORKERS or 1")
    parser.add_argument("--threads", type=int, help="request threads per worker (default 64)")
    parser.add_argument("--timeout", type=int, default=120, help="gunicorn worker heartbeat timeout, seconds")
    parser.add_argument("--log-level", default=os.environ.get("LMI_SERVE_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", choices=logs.FORMATS, default=os.environ.get("LMI_SERVE_LOG_FORMAT", "text"),
                        help="text, or json: one JSON object per line, every log line (default LMI_SERVE_LOG_FORMAT "
                             "or text)")
    args = parser.parse_args(argv)
    if args.log_format not in logs.FORMATS:  # argparse checks choices on the command line only, not a default
        parser.error(f"LMI_SERVE_LOG_FORMAT must be one of {', '.join(logs.FORMATS)}, not {args.log_format!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    for key, value in _RUNTIME_ENV.items():
        os.environ.setdefault(key, value)
    env = dict(os.environ)
    if args.workers:
        env["SAGEMAKER_NUM_MODEL_WORKERS"] = str(args.workers)
    if args.threads:
        env["SERVING_THREADS"] = str(args.threads)
    try:
        config = build_server_config(env, model_dir=args.model_dir, model_store=args.model_store,
                                     host=args.host, port=args.port, default_store=DEFAULT_STORE)
    except ConfigError as exc:
        print(f"lmi-serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    # Each worker's own GPUs (server/gpus.py) and, with option.engine_replicas, its own CPUs
    # (server/cpu_replicas.py): too many workers for either is a configuration error too.
    workers_set = "--workers" if args.workers else next(
        (name for name in ("SAGEMAKER_NUM_MODEL_WORKERS", "SERVING_MAX_WORKERS") if env.get(name, "").strip()), None)
    budget = cpu_budget(config.cpu_threads, env)
    try:
        gpus = count_gpus(env)
        layout = plan_replicas(config, budget, affinity_cpus(), gpus=gpus or 0,
                               workers_key=workers_set)
        config = config.model_copy(update={"workers": layout.replicas})
        gpu_plan = plan_gpus(config, gpus, env, workers_set or "workers")
    except ConfigError as exc:
        print(f"lmi-serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    log.info("Configuration:\n%s", config.describe())
    log.info("%s", gpu_plan.describe())
    log.info("%s", budget.describe(config.workers))  # each worker sizes torch by it
    log.info("%s", layout.describe())
    security.log_startup(config.security)
    for model in config.models:
        if model.unknown_options:
            log.warning("Model %s: options %s are not lmi-serve options; they are passed to the handler only",
                        model.name, ", ".join(model.unknown_options))
        if model.ignored_options:
            log.warning("Model %s: %s ignored: not for %s models (the variable applies to every model of the "
                        "store; set it in a model's serving.properties to name one)", model.name,
                        ", ".join(model.ignored_options), KIND_NAMES.get(model.task or "", model.task))
    run_gunicorn(config, args, gpu_plan, layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
