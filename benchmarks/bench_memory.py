"""Worker memory after long prompts: does RSS come back to its warm idle value?

Starts the default server, warms it with short requests, then sends --prompts long prompts
(--words words each, max_new_tokens 1, one at a time) and prints the worker's RSS (and its anonymous
and file-backed parts) at: warm idle, after each long prompt, idle after them (polled until it stops
falling, at most --settle seconds), and, where gdb may attach, after a `malloc_trim(0)` called in the
worker by gdb, with glibc's `malloc_stats()` (arenas, bytes held vs in use) before and after it. What
the trim gives back was freed heap glibc kept; what stays is held by something alive.

Run: .venv/bin/python -m benchmarks.bench_memory [--prompts 4] [--words 6000]
"""

from __future__ import annotations

import argparse
import random
import signal
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests

from benchmarks.benchmark.common import cpu_summary
from benchmarks.benchmark.suite import helper
from benchmarks.soak import worker_pid

ROOT = Path(__file__).resolve().parents[1]
ServerProcess = helper("server_process").ServerProcess

WORDS = "apple river stone cloud market silver garden window bridge forest engine letter candle mountain ocean".split()


def memory(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of `pid` in MiB, and its thread count."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    out = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    out["Threads"] = int(fields["Threads"])
    return out


def line(label: str, pid: int, warm: float | None = None) -> float:
    m = memory(pid)
    vs = f" ({100 * (m['VmRSS'] / warm - 1):+.1f}% of warm idle)" if warm else ""
    print(f"{label:<34} RSS {m['VmRSS']:7.0f} MiB{vs}   anon {m['RssAnon']:6.0f}   file {m['RssFile']:5.0f}   "
          f"peak {m['VmHWM']:6.0f}   threads {m['Threads']}", flush=True)
    return m["VmRSS"]


def settle(pid: int, seconds: float) -> None:
    """Wait until RSS stops falling (two 1 s samples within 1 MiB), at most `seconds`."""
    end, last = time.monotonic() + seconds, memory(pid)["VmRSS"]
    while time.monotonic() < end:
        time.sleep(1)
        now = memory(pid)["VmRSS"]
        if last - now < 1:
            return
        last = now


def gdb_call(pid: int, expression: str) -> bool:
    """Call `expression` inside the worker with gdb; False where gdb is missing or may not attach."""
    if not shutil.which("gdb"):
        return False
    done = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", f"call {expression}"],
                          capture_output=True, text=True, timeout=120)
    refused = ("ptrace", "Operation not permitted", "Could not attach", "No symbol")
    return done.returncode == 0 and not any(word in done.stdout + done.stderr for word in refused)


def malloc_stats(server: ServerProcess, pid: int) -> str:
    """glibc's malloc_stats() of the worker (written to its stderr, the server log), summarised."""
    before = len(server.output())
    if not gdb_call(pid, "(void)malloc_stats()"):
        return "malloc_stats: gdb cannot attach"
    time.sleep(0.5)
    text = server.output()[before:]
    arenas = len(re.findall(r"^Arena \d+:", text, re.M))
    system = re.search(r"Total \(incl. mmap\):\nsystem bytes\s*=\s*(\d+)\nin use bytes\s*=\s*(\d+)", text)
    if not system:
        return "malloc_stats: no output"
    held, used = (int(g) / 2**20 for g in system.groups())
    return f"glibc: {arenas} arenas, {held:.0f} MiB held from the system, {used:.0f} MiB in use"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=6000)
    parser.add_argument("--settle", type=float, default=30, help="seconds to wait for RSS to stop falling")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started (finally)
    print(f"CPU: {cpu_summary()}; {args.prompts} prompts of {args.words} words, max_new_tokens 1", flush=True)
    rng = random.Random(0)
    server = ServerProcess()
    try:
        server.wait_for_ping(timeout=600)
        pid = worker_pid(server.proc.pid)
        for _ in range(3):
            requests.post(server.url("/invocations"), json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}},
                          timeout=120).raise_for_status()
        settle(pid, args.settle)
        warm = line("warm idle", pid)
        for i in range(args.prompts):
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.words))
            started = time.monotonic()
            answer = requests.post(server.url("/invocations"), timeout=1200,
                                   json={"inputs": prompt, "parameters": {"max_new_tokens": 1}})
            answer.raise_for_status()
            line(f"after long prompt {i + 1} ({time.monotonic() - started:.0f} s)", pid, warm)
        settle(pid, args.settle)
        line("idle after the long prompts", pid, warm)
        print(malloc_stats(server, pid), flush=True)
        if gdb_call(pid, "(int)malloc_trim(0)"):
            line("after malloc_trim(0) by gdb", pid, warm)
            print(malloc_stats(server, pid), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
