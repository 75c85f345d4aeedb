"""What a client sees of the server while it boots: seconds from spawn to the port being bound, to
the first answer to /ping (any status), and to a healthy /ping; the longest a single /ping waited
for its answer; and the statuses seen. The gap between "bound" and "first answer" is the worker's
own start (gunicorn forks it, then it imports the app) during which connections wait in the backlog.

Run: .venv/bin/python -m benchmarks.bench_boot [--runs N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import socket
import statistics
import time

import requests

from benchmarks.benchmark.suite import helper
ServerProcess = helper("server_process").ServerProcess


def bound(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def measure(args: list[str]) -> dict:
    started = time.monotonic()
    server = ServerProcess(*args)
    statuses: collections.Counter = collections.Counter()
    figures: dict = {"longest_wait": 0.0}
    try:
        while not bound(server.port):
            time.sleep(0.01)
        figures["bound"] = time.monotonic() - started
        while "healthy" not in figures and time.monotonic() - started < 600:
            sent = time.monotonic()
            try:
                response = requests.get(server.url("/ping"), timeout=60)
            except requests.RequestException as exc:
                statuses[type(exc).__name__] += 1
                continue
            now = time.monotonic()
            figures["longest_wait"] = max(figures["longest_wait"], now - sent)
            kind = response.headers.get("Content-Type", "").split(";")[0]
            statuses[f"{response.status_code} {kind}"] += 1
            figures.setdefault("first_answer", now - started)
            if response.status_code == 200:
                figures["healthy"] = now - started
            time.sleep(0.05)
        figures["statuses"] = dict(statuses)
        return figures
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-dir", help="serve this model (default: the embedded defaults)")
    options = parser.parse_args()
    args = ["--model-dir", options.model_dir] if options.model_dir else []
    runs = []
    for run in range(options.runs):
        figures = measure(args)
        runs.append(figures)
        print(f"run {run + 1}: bound {figures['bound']:.2f} s, first /ping answer {figures['first_answer']:.2f} s, "
              f"healthy {figures['healthy']:.2f} s, longest /ping wait {figures['longest_wait']:.2f} s, "
              f"answers {figures['statuses']}", flush=True)
    median = {key: statistics.median(r[key] for r in runs) for key in ("bound", "first_answer", "healthy", "longest_wait")}
    print(f"\nmedian of {len(runs)}: bound {median['bound']:.2f} s; first answer {median['first_answer']:.2f} s "
          f"({median['first_answer'] - median['bound']:.2f} s after the bind); healthy {median['healthy']:.2f} s; "
          f"longest single /ping wait {median['longest_wait']:.2f} s")


if __name__ == "__main__":
    main()
