"""Normal request latency with and without slow client connections, on one server in one run.

Starts the server (embedded defaults), then for `--duration` seconds each:
1. baseline: `--clients` threads send normal requests (/ping, a 4-token LMI and OpenAI generation,
   each on a fresh connection);
2. pressure: the same, while `--slow` connections trickle a request head or body one byte every
   `--interval` seconds, or sit idle (benchmarks/benchmark/slow_clients.py).
Prints each phase's p50/p99 latency, the pressure/baseline ratios, the normal requests that failed
(timeout `--timeout`), and what became of the slow connections (408, closed, still open).

    .venv/bin/python -m benchmarks.bench_slow_clients [--slow 200] [--duration 30] [--threads 64]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

from benchmarks.benchmark.slow_clients import NormalLoad, SlowSockets, percentile  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_server(port: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile(prefix="bench-slow-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "lmi_serve", "--port", str(port)]
    if threads:
        command += ["--threads", str(threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200:
                return proc, log.name
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not become healthy; see {log.name}")


def loop_cpu(master_pid: int) -> float:
    """CPU seconds used so far by the main threads of the server's workers: gunicorn's event loop,
    where requests are now read (the request threads and the engine are other threads)."""
    total = 0.0
    for worker in psutil.Process(master_pid).children():
        total += sum(t.user_time + t.system_time for t in worker.threads() if t.id == worker.pid)
    return total


def run_phase(base: str, port: int, args: argparse.Namespace, slow: int) -> tuple[NormalLoad, SlowSockets | None]:
    sockets = None
    if slow:
        kinds = tuple(args.kinds.split(","))
        sockets = SlowSockets("127.0.0.1", port, slow, interval=args.interval, kinds=kinds).start()
    load = NormalLoad(base, clients=args.clients, timeout=args.timeout).start()
    time.sleep(args.duration)
    load.stop()
    if sockets is not None:
        sockets.stop()
    return load, sockets


def figures(values: list[float]) -> tuple[int, float, float]:
    values = sorted(values)
    return len(values), percentile(values, 50), percentile(values, 99)


def report(baseline: NormalLoad, pressure: NormalLoad) -> None:
    """One row per normal request kind and one for all: count, p50, p99 in each phase, and ratios."""
    print(f"{'request':8s} {'baseline n / p50 / p99 (ms)':>30s}   {'pressure n / p50 / p99 (ms)':>30s}   "
          "ratio p50 / p99")
    rows = [(name, baseline.latencies[name], pressure.latencies[name]) for name in baseline.latencies]
    for name, before, during in rows + [("all", baseline.all_latencies(), pressure.all_latencies())]:
        (bn, b50, b99), (pn, p50, p99) = figures(before), figures(during)
        ratio = (lambda a, b: a / b if b and not math.isnan(a) else float("nan"))
        print(f"{name:8s} {bn:10d} / {b50 * 1000:7.1f} / {b99 * 1000:7.1f}   {pn:10d} / {p50 * 1000:7.1f} / "
              f"{p99 * 1000:7.1f}   {ratio(p50, b50):5.2f}x / {ratio(p99, b99):5.2f}x")
    for label, load in (("baseline", baseline), ("pressure", pressure)):
        print(f"{label} failures: {len(load.failures)}")
        for name, error in load.failures[:5]:
            print(f"  {name}: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=200, help="slow connections during the pressure phase")
    parser.add_argument("--duration", type=float, default=30, help="seconds per phase")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between a slow socket's bytes")
    parser.add_argument("--kinds", default="head,body,idle", help="slow connection kinds, in turn")
    parser.add_argument("--clients", type=int, default=2, help="threads sending normal requests")
    parser.add_argument("--timeout", type=float, default=30, help="a normal request's timeout, seconds")
    parser.add_argument("--threads", type=int, help="server request threads (default: the server's)")
    parser.add_argument("--port", type=int, default=8093)
    args = parser.parse_args()

    proc, log = start_server(args.port, args.threads)
    base = f"http://127.0.0.1:{args.port}"
    try:
        NormalLoad(base).one("lmi")  # warm up
        print(f"{cpu_summary()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before")
        print(f"server threads {args.threads or 'default'}; {args.clients} normal clients; {args.slow} slow "
              f"sockets ({args.kinds}), a byte every {args.interval} s; {args.duration:.0f} s per phase")
        cpu = [loop_cpu(proc.pid)]
        baseline, _ = run_phase(base, args.port, args, 0)
        cpu.append(loop_cpu(proc.pid))
        pressure, sockets = run_phase(base, args.port, args, args.slow)
        cpu.append(loop_cpu(proc.pid))
        report(baseline, pressure)
        print(f"workers' event-loop threads: {(cpu[1] - cpu[0]) / args.duration:.1%} of a core in the baseline, "
              f"{(cpu[2] - cpu[1]) / args.duration:.1%} under pressure")
        for kind, outcomes in sockets.outcomes.items():
            print(f"slow {kind:5s}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
        print(f"slow sockets opened: {sockets.opened}; load average {os.getloadavg()[0]:.1f} after")
        try:
            after = NormalLoad(base).one("ping")
            print(f"after     /ping answered in {after * 1000:.0f} ms")
        except Exception as error:
            print(f"after     /ping failed: {error}")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"server log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
