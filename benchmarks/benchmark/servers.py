"""Servers: model directories, the server processes (ours, llama-server, vLLM CPU), their warm-up, and the
rule that a system whose server cannot start is skipped, with the reason from its log."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .clients import DynamicClient, stream_one
from .common import LLAMA_SYSTEMS, VLLM_SYSTEMS, ModelSource, log
from .llama import LlamaServer, Unavailable, system_source
from .suite import helper
from .vllm_cpu import VllmServer
from .workload import Workload

ROLLING_BASE = {"rolling_batch": "scheduler", "predict_timeout": 600}
# Each rolling system: the options it adds to ROLLING_BASE. A system whose options the server does
# not know yet (it warns "not lmi-serve options" and would silently ignore them) is skipped.
ROLLING_OPTIONS: dict[str, dict[str, Any]] = {
    "rolling": {"kv_cache": "slots"},  # and option.linear_kernel=auto: oneDNN's packed fp32 weights on a CPU
    # The path before the fast engine: transformers' DynamicCache and torch's nn.Linear (MKL).
    "rolling-dynamic": {"kv_cache": "dynamic", "linear_kernel": "torch"},
    "rolling-linear-torch": {"kv_cache": "slots", "linear_kernel": "torch"},  # rolling less the oneDNN layers
    "rolling-fp16": {"kv_cache": "slots", "quantize": "fp16"},
    "rolling-q4": {"kv_cache": "slots", "quantize": "q4"},
    # bf16 weights and activations, Linear layers on oneDNN's bf16 matmul (AMX / avx512_bf16; emulated elsewhere)
    "rolling-bf16": {"kv_cache": "slots", "dtype": "bf16"},
    # the GGUF's own 4-bit blocks on torch's int4 kernel, bf16 activations (its vector path); lm_head bf16 oneDNN
    "rolling-q4-bf16": {"kv_cache": "slots", "quantize": "q4", "dtype": "bf16"},
    "rolling-no-prefix": {"kv_cache": "slots", "enable_prefix_caching": "false"},
    # n-gram speculation (engine/speculation.py): a batch of one row verifies prompt-lookup drafts
    "rolling-ngram": {"kv_cache": "slots", "draft_model_id": "ngram"},
    # rolling less the decode attention kernel (kernels/cpu/decode_kernel.py): torch's SDPA in every step
    "rolling-sdpa": {"kv_cache": "slots", "decode_attention": "sdpa"},
    # rolling less one forward per step (engine/kv/mixed.py): every joiner's prompt in a forward of its own
    "rolling-separate": {"kv_cache": "slots", "mixed_steps": "false"},
    # rolling less the row kernel (kernels/cpu/row_kernel.py): one to eight rows on oneDNN too, no second copy
    "rolling-no-row": {"kv_cache": "slots", "row_kernel": "off"},
    # rolling less the step pace (engine/pace.py): the prompt-token budget alone bounds a step
    "rolling-unpaced": {"kv_cache": "slots", "max_rolling_batch_step_seconds": 0},
    # rolling with fewer rows than clients (at 32): joiners wait for a row, each step decodes fewer
    "rolling-24-rows": {"kv_cache": "slots", "max_rolling_batch_size": 24},
    # rolling-q4-bf16 on the Q4_K_M GGUF llama-quantize makes from the F32 copy (llama-server-q4km's file)
    "rolling-q4km-bf16": {"kv_cache": "slots", "quantize": "q4", "dtype": "bf16"},
}


@dataclass
class ServerSettings:
    max_rolling: int = 32
    dynamic_batch: int = 32
    prefill_budget: int | None = None  # option.max_rolling_batch_prefill_tokens of every rolling server
    llama_slots: int = 32  # -np: the largest concurrency the workload drives
    llama_ctx_per_slot: int = 512
    llama_threads: int = 2
    llama_prompt_cache: bool = False
    vllm_max_seqs: int = 32  # --max-num-seqs: the largest concurrency the workload drives
    vllm_max_model_len: int = 512  # --max-model-len: the longest prompt + output
    vllm_threads: int = 2  # VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>
    vllm_kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (SmolLM2-135M fp32: ~45 KiB a token, so ~46k tokens)
    extra_options: dict[str, Any] = field(default_factory=dict)


def write_model_dir(parent: Path, name: str, options: dict[str, Any], source: ModelSource) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    lines = source.properties()
    lines += [f"option.{k}={v}" for k, v in options.items()]
    (folder / "serving.properties").write_text("\n".join(lines) + "\n")
    return folder


def our_options(name: str, settings: ServerSettings) -> dict[str, Any]:
    if name == "dynamic":
        return {"rolling_batch": "disable", "batch_size": settings.dynamic_batch, "max_batch_delay": 50,
                "predict_timeout": 600}
    options = {**ROLLING_BASE, "max_rolling_batch_size": settings.max_rolling, **ROLLING_OPTIONS[name]}
    if settings.prefill_budget is not None:
        options["max_rolling_batch_prefill_tokens"] = settings.prefill_budget
    return {**options, **settings.extra_options}


def phase_split(server) -> str | None:
    """Where a rolling server's engine spent its steps (GET /models/<m>: engine.phaseSeconds, see
    engine/phases.py), as shares of the total, or None for a server without an engine."""
    import requests

    try:
        name = requests.get(server.url("/models"), timeout=10).json()["models"][0]["modelName"]
        engine = requests.get(server.url(f"/models/{name}"), timeout=10).json()[0]["models"][0].get("engine")
    except (requests.RequestException, ValueError, KeyError, IndexError):
        return None
    seconds = (engine or {}).get("phaseSeconds") or {}
    total = sum(seconds.values())
    if not total:
        return None
    shares = ", ".join(f"{phase} {100 * s / total:.0f}%" for phase, s in seconds.items())
    return f"{total:.0f} s in steps: {shares}"


def failure_reason(log_text: str) -> str:
    """The line of a server log that says why it did not start (or the last line)."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for pattern in (r"invalid configuration", r"not lmi-serve options", r"Error|error:|CRITICAL"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][-400:]
    return lines[-1][-400:] if lines else "no output"


def ignored_options(log_text: str, options: dict[str, Any]) -> list[str]:
    """The options of this system that the server's log says it does not know (it would ignore them)."""
    warned = " ".join(ln for ln in log_text.splitlines() if "not lmi-serve options" in ln)
    return [k for k in options if k not in ROLLING_BASE and re.search(rf"\b{re.escape(k)}\b", warned)]


class Servers:
    """Starts every requested server at once, waits for each, and keeps the ones that came up.
    `servers`: name -> process; `skipped`: name -> why it is not measured."""

    def __init__(self, workdir: Path, systems: list[str], settings: ServerSettings, source: ModelSource):
        self.servers: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        self.options: dict[str, dict[str, Any]] = {}
        env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        try:
            self._start(systems, settings, source, workdir, env)
        except BaseException:  # interrupted while starting them: stop those already started
            self.stop()
            raise

    def _start(self, systems: list[str], settings: ServerSettings, source: ModelSource, workdir: Path,
               env: dict[str, str]) -> None:
        ServerProcess = helper("server_process").ServerProcess

        for name in systems:
            try:
                if name in LLAMA_SYSTEMS:
                    server = LlamaServer(name, source, settings.llama_slots, settings.llama_ctx_per_slot,
                                         settings.llama_threads, settings.llama_prompt_cache)
                elif name in VLLM_SYSTEMS:
                    server = VllmServer(source, settings.vllm_max_seqs, settings.vllm_max_model_len,
                                        settings.vllm_threads, settings.vllm_kv_cache_gib,
                                        dtype="bfloat16" if name == "vllm-cpu-bf16" else "float32")
                elif name in ROLLING_OPTIONS or name == "dynamic":
                    self.options[name] = our_options(name, settings)
                    folder = write_model_dir(workdir, name, self.options[name], system_source(name, source))
                    server = ServerProcess("--model-dir", str(folder), env=env)
                else:
                    continue
            except Unavailable as exc:
                self.skip(name, str(exc))
                continue
            self.servers[name] = server
            log(f"started {name} server (pid {server.proc.pid}, {server.base})")

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason
        log(f"skipped: {name}: {reason}")

    def wait(self) -> None:
        """Wait for each server; one that exits, never answers, or ignores its options is skipped."""
        for name, server in list(self.servers.items()):
            started = time.monotonic()
            try:
                server.wait_for_ping(timeout=600)
            except (RuntimeError, TimeoutError) as exc:
                self.drop(name, failure_reason(server.output() or str(exc)))
                continue
            unknown = ignored_options(server.output(), self.options.get(name, {}))
            if unknown:
                self.drop(name, f"the server does not know option.{', option.'.join(unknown)} yet "
                                f"({failure_reason(server.output())})")
                continue
            log(f"{name} server healthy after {time.monotonic() - started:.1f} s more")

    def drop(self, name: str, reason: str) -> None:
        server = self.servers.pop(name)
        try:
            server.stop()
        except Exception as exc:  # noqa: BLE001
            log(f"stopping {name} failed: {exc}")
        self.skip(name, reason)

    def stop(self) -> None:
        for server in self.servers.values():
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001
                log(f"stopping a server failed: {exc}")

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers.values()]


def warm_up(name: str, server, workload: Workload, dyn: DynamicClient | None, send=None, path: str = "") -> list[str]:
    """Two short requests (compiles kernels, allocates); for dynamic, probe ignore_eos_token.
    `send`/`path`: the system's sender and route when it is not the LMI streaming one."""
    import requests

    notes = []
    url = server.url(path or "/invocations")
    for k in range(2):
        _, prompt, _ = workload.request(k)
        if name != "dynamic":
            rec = (send or stream_one)(requests.Session(), url, prompt, 8)
            if not rec["ok"]:
                raise RuntimeError(f"{name} warm-up failed: {rec['error']}\n{server.output()[-3000:]}")
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
