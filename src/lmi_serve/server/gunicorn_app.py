"""gunicorn, run in this process as the arbiter of the worker processes (`run_gunicorn`).

Workers are gthread workers (a thread per connection, so a stream never pins a process) that
answer HTTP-layer errors in JSON (http_worker.py). Each worker first serves a stand-in app that
answers /ping at once (boot.py), imports the real one on a thread, then loads its own copy of every
model after the fork. SIGTERM drains (drain.py).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Any

from lmi_serve.config.sources import ServerConfig
from lmi_serve.server import cpu_replicas, gpus, logs
from lmi_serve.server.cpu_replicas import ReplicaLayout
from lmi_serve.server.gpus import GpuPlan


def gunicorn_settings(config: ServerConfig, args: argparse.Namespace, metrics_dir: str,
                      gpu_plan: GpuPlan | None = None, layout: ReplicaLayout | None = None) -> dict[str, Any]:
    """gunicorn's settings for this server: the bind, workers and threads from the config, the
    timeouts, logging through logs.py, the hooks that keep multiprocess metrics right, and those
    that give each worker a slot, its own GPUs (gpus.py) and its own CPUs (cpu_replicas.py)."""
    from lmi_serve.server import drain, metrics

    plan = gpu_plan or GpuPlan(config.workers)
    cores = layout or ReplicaLayout(config.workers, 1)  # unpinned

    return {
        "bind": f"{config.host}:{config.port}",
        "workers": config.workers,
        "worker_class": "lmi_serve.server.http_worker.JsonErrorWorker",  # gthread; HTTP-layer errors in JSON
        "threads": config.threads,
        "timeout": args.timeout,
        # SIGTERM drains (drain.py): in-flight requests get this long before they are ended.
        "graceful_timeout": math.ceil(config.graceful_timeout),  # gunicorn takes whole seconds
        "keepalive": 5,
        "loglevel": args.log_level,
        "errorlog": "-",
        "logconfig_dict": logs.gunicorn_logconfig(args.log_level, args.log_format),  # logs.py
        "preload_app": False,  # models load after the fork, in each worker
        "proc_name": "lmi-serve",
        # The documented model selector header is `model_name`; gunicorn's default drops every
        # header whose name has an underscore. "dangerous" keeps them, mapped as if spelled
        # with hyphens (`model_name` and `Model-Name` are one header to the application).
        "header_map": "dangerous",
        # One fixed path per user ($HOME/.gunicorn/gunicorn.ctl): two servers on one machine
        # would take each other's socket; nothing here uses gunicornc.
        "control_socket_disable": True,
        # A dead worker's live gauges (running, waiting) must leave the sums; its counts stay.
        "child_exit": lambda server, worker: metrics.worker_exited(worker.pid),
        "on_exit": lambda server: metrics.remove_multiprocess_dir(metrics_dir),
        "worker_exit": lambda server, worker: drain.on_worker_exit(worker),  # flush trace spans (tracing.py)
        # A worker's slot (a replacement takes the dead one's) and, after the fork, that slot's GPUs and CPUs.
        "pre_fork": lambda server, worker: gpus.assign_slot(server, worker, plan),
        "post_fork": lambda server, worker: (gpus.enter_slot(worker, plan),
                                             cpu_replicas.enter_core_set(worker, cores)),
    }


def run_gunicorn(config: ServerConfig, args: argparse.Namespace, gpu_plan: GpuPlan | None = None,
                 layout: ReplicaLayout | None = None) -> None:
    from gunicorn.app.base import BaseApplication

    from lmi_serve.server.boot import BootingApp
    from lmi_serve.server.drain import DrainingArbiter

    # Multiprocess metrics (metrics.py): a fresh private folder per start, so no earlier server's
    # counts leak in, set before prometheus_client is first imported (it picks its value store at
    # import, and the workers fork from this process).
    metrics_dir = tempfile.mkdtemp(prefix="lmi-serve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from lmi_serve.server import metrics

    class Server(BaseApplication):
        def load_config(self) -> None:
            for key, value in gunicorn_settings(config, args, metrics_dir, gpu_plan, layout).items():
                self.cfg.set(key, value)

        def load(self):
            def create():
                from lmi_serve.server.app import create_app  # seconds: torch, transformers, every dialect

                return create_app(config)

            # Answers at once (/ping: loading) while the app imports on a thread (boot.py).
            # /metrics meanwhile only where it needs no key: the gate is the real app's (security.py)
            open_metrics = config.security.public_metrics or not config.security.keys_required
            return BootingApp([model.name for model in config.models], create,
                              metrics.ServingMetrics().render if open_metrics else None)

        def run(self) -> None:
            DrainingArbiter(self).run()  # gunicorn's arbiter, draining on SIGTERM

    Server().run()
