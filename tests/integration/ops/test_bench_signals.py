"""scripts/bench stops the same way on SIGTERM as on SIGINT: the servers it started are stopped (no
process of theirs is left), and it exits promptly with 128 + the signal's number."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def process_group(pgid: int) -> list[psutil.Process]:
    """The live processes of a process group (a server started in its own session leads one)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_bench_stops_its_servers_and_exits_with_the_signal(tmp_path, sig):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLAMA_CPP_HOME": str(tmp_path / "no-llama")}
    bench = subprocess.Popen([sys.executable, "-m", "benchmarks.bench", "--quick", "--systems", "rolling"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid, seen = None, []
    try:
        for line in bench.stderr:  # until the bench says it started the server (it is still loading)
            seen.append(line)
            if match := re.search(r"started rolling server \(pid (\d+)", line):
                server_pid = int(match.group(1))
                break
        assert server_pid is not None, "".join(seen)
        assert process_group(server_pid)
        bench.send_signal(sig)
        stdout, stderr = bench.communicate(timeout=120)  # ServerProcess.stop: SIGTERM, SIGKILL after 30 s
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + sig, stderr[-3000:]
    assert f"interrupted by {sig.name}; the servers it started are stopped" in stderr
    assert "Traceback" not in stderr and stdout == ""
    assert process_group(server_pid) == []
