"""Start the real server as a subprocess, exactly as `scripts/serve` runs it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Configuration variables of the server must come from the test, never from the caller's shell.
_CONFIG_PREFIXES = ("OPTION_", "SERVING_", "SAGEMAKER_", "HF_MODEL_", "HF_TASK", "HF_REVISION", "TENSOR_PARALLEL",
                    "SM_NUM_GPUS", "MAX_BATCH_SIZE", "MAX_CONCURRENT_REQUESTS", "DJL_", "PREDICT_TIMEOUT",
                    "MODEL_LOADING_TIMEOUT", "LMI_SERVE_API_KEYS", "LMI_SERVE_ADMIN_API_KEYS", "LMI_SERVE_PUBLIC_METRICS",
                    "LMI_SERVE_ENABLE_MANAGEMENT_API", "LMI_SERVE_ADAPTERS_ROOT", "LMI_SERVE_MAX_REQUEST_BYTES",
                    "LMI_SERVE_LOG_FORMAT", "LMI_SERVE_STRICT_MODEL_NAMES", "LMI_SERVE_OTLP_", "OTEL_")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server starts with: the caller's, less the server's configuration variables, plus `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_CONFIG_PREFIXES)}
    return {**clean, "PYTHONUNBUFFERED": "1", **(env or {})}


class ServerProcess:
    """`python -m lmi_serve` on a free port; ready when /ping answers 200. `python` and `cwd` are the
    project's interpreter and checkout unless a test serves from elsewhere (an installed wheel)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, python: str = sys.executable,
                 cwd: Path = ROOT):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = process_env(env)
        self.args = ["--port", str(self.port), *args]
        self.log = tempfile.NamedTemporaryFile(prefix="lmi-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, "-m", "lmi_serve", *self.args], cwd=cwd, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, path: str) -> str:
        return self.base + path

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def complete_lines(self) -> list[str]:
        """The log's finished lines: a line the server is still writing (a long JSON record can reach
        the file in two writes) is left out rather than read half-written."""
        text = self.output()
        return text[:text.rfind("\n") + 1].splitlines()

    def wait_for_ping(self, accept=(200,), timeout: float = 420) -> requests.Response:
        """Poll /ping until it answers a status in `accept`. Refused connections (before the bind)
        and timeouts (a loaded machine) are retried until `timeout`; the server exiting fails."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                last = requests.get(self.url("/ping"), timeout=5)
                if last.status_code in accept:
                    return last
            except (requests.ConnectionError, requests.Timeout):  # a loaded machine: keep polling
                pass
            time.sleep(0.5)
        raise TimeoutError(f"/ping never answered {accept} (last: {last and last.status_code}):\n{self.output()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM (the server drains: quick when nothing is in flight); a request a test left
        running would hold it for the graceful timeout, so after a while a second SIGTERM ends it
        at once; SIGKILL if even that fails."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGTERM, 20), (signal.SIGKILL, None)):
            if self.proc.poll() is not None:
                break
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        self.log.close()


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str] | None = None, timeout: float = 420, python: str = sys.executable,
            cwd: Path = ROOT) -> Iterator[ServerProcess]:
    """A ServerProcess once /ping has answered 200, stopped on leaving the block (a fixture's
    `with serving(...) as server: yield server`)."""
    server = ServerProcess(*args, env=env, python=python, cwd=cwd)
    try:
        server.wait_for_ping(timeout=timeout)
        yield server
    finally:
        server.stop()


def wait_for(predicate, timeout: float = 60) -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds (never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")
