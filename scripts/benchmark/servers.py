"""Servers: model directories, the two server processes and their warm-up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .clients import DynamicClient, stream_one
from .common import ModelSource, log
from .workload import Workload


def write_model_dir(parent: Path, name: str, options: dict[str, Any], source: ModelSource) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    lines = source.properties()
    lines += [f"option.{k}={v}" for k, v in options.items()]
    (folder / "serving.properties").write_text("\n".join(lines) + "\n")
    return folder


class Servers:
    def __init__(self, workdir: Path, systems: list[str], dynamic_batch: int, max_rolling: int,
                 source: ModelSource):
        from server_process import ServerProcess

        self.servers: dict[str, Any] = {}
        specs = {
            "rolling": {"rolling_batch": "scheduler", "max_rolling_batch_size": max_rolling, "predict_timeout": 600,
                        "kv_cache": "slots"},
            # the rolling batch on transformers' DynamicCache (the KV baseline of option.kv_cache)
            "rolling-dynamic": {"rolling_batch": "scheduler", "max_rolling_batch_size": max_rolling,
                                "predict_timeout": 600, "kv_cache": "dynamic"},
            "dynamic": {"rolling_batch": "disable", "batch_size": dynamic_batch, "max_batch_delay": 50,
                        "predict_timeout": 600},
        }
        env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        for name in systems:
            if name in specs:
                folder = write_model_dir(workdir, name, specs[name], source)
                self.servers[name] = ServerProcess("--model-dir", str(folder), env=env)
                log(f"started {name} server (pid {self.servers[name].proc.pid}, {self.servers[name].base})")

    def wait(self) -> None:
        for name, server in self.servers.items():
            started = time.monotonic()
            server.wait_for_ping(timeout=600)
            log(f"{name} server healthy after {time.monotonic() - started:.1f} s more")

    def stop(self) -> None:
        for server in self.servers.values():
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001
                log(f"stopping a server failed: {exc}")

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers.values()]


def warm_up(name: str, server, workload: Workload, dyn: DynamicClient | None) -> list[str]:
    """Two short requests (compiles kernels, allocates); for dynamic, probe ignore_eos_token."""
    import requests

    notes = []
    url = server.url("/invocations")
    for k in range(2):
        _, prompt, _ = workload.request(k)
        if name == "rolling":
            rec = stream_one(requests.Session(), url, prompt, 8)
            if not rec["ok"]:
                raise RuntimeError(f"rolling warm-up failed: {rec['error']}\n{server.output()[-3000:]}")
        else:
            assert dyn is not None
            resp = requests.post(url, json=dyn.payload(prompt, 8), timeout=300)
            if resp.status_code != 200 and dyn.send_ignore_eos and "ignore_eos" in resp.text:
                try:
                    why = resp.json().get("error", resp.text)
                except ValueError:
                    why = resp.text
                notes.append(f"dynamic batching rejected parameters.ignore_eos_token (HTTP {resp.status_code}: "
                             f"{str(why).strip()[:110]}...); it ran WITHOUT it, so its requests may stop at EOS "
                             "before max_new_tokens, and its output tokens are counted by re-tokenizing the text")
                dyn.send_ignore_eos = False
                resp = requests.post(url, json=dyn.payload(prompt, 8), timeout=300)
            if resp.status_code != 200:
                raise RuntimeError(f"dynamic warm-up failed: HTTP {resp.status_code} {resp.text[:300]}")
    return notes
