#!/usr/bin/env python3
"""Body inspection before JSON decoding: the former scan (a regular expression stripping strings,
then numpy) against json_scan.scan (one chunked numpy pass), in the same run.

1. In process, per body shape: seconds per MiB and peak extra memory (tracemalloc) of each scan
   (the old one without Triton's outline, which its routes computed in further passes),
   and, for scale, what json.loads then takes (one call into the C decoder: the GIL is held for
   all of it, which the scan does not change).
2. Against real servers (the default model store, body limit --size), one with each scan: for
   one body of each shape and route, the largest inter-token gap of a stream running on the same
   worker, the slowest /ping, and the worker's RSS growth (benchmarks/benchmark/body_probe.py).
   The former scan is put back into a server by replacing `json_scan.scan` before the workers
   fork; it then runs once per body, where the former routes ran it up to five times, so the
   baseline here flatters it.
3. With --decode, instead: the decoder's shapes (millions of keys, one array of millions of
   numbers, rows of 16 numbers) against two servers running side by side, before and after, one
   body at a time, alternating which goes first: this tree as it is, and before it either the
   source tree given by --before-src (e.g. `git archive <commit> src | tar -x -C DIR`, then DIR/src)
   or, without it, this tree with its key cap ignored. Stream gap, /ping and RSS peak as above, the
   stream's median gap before the body (the box's own pace), and the load average; with --repeat N,
   N rounds and their medians.

    .venv/bin/python -m benchmarks.bench_body_scan [--size BYTES] [--skip-servers]
    .venv/bin/python -m benchmarks.bench_body_scan --decode --size 67108864 [--before-src DIR/src] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.benchmark.body_probe import DECODE_SHAPES, ROUTES, SHAPES, body, probe, worker_process  # noqa: E402
from benchmarks.benchmark.common import cpu_summary  # noqa: E402
from lmi_serve import json_scan
from lmi_serve.json_scan import BodyScan  # noqa: E402

# --- the former scan, kept as the baseline ---------------------------------------------------
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def old_scan(data: bytes, outline_depth: int | None = None, *, chunk_size: int = 0) -> BodyScan:
    """json_body.nesting_depth and triton's flatten_below as they were, behind scan's interface."""
    skeleton = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    depth = int(np.cumsum(_STEP[skeleton], dtype=np.int32).max(initial=0)) if skeleton.size else 0
    surrogate = _SURROGATE_ESCAPE.search(data) is not None
    if outline_depth is None:
        return BodyScan(depth, surrogate)
    masked = _STRING.sub(lambda m: b'"' + b" " * (len(m.group()) - 2) + b'"', data)
    steps = _STEP[np.frombuffer(masked, dtype=np.uint8)]
    own_level = np.cumsum(steps) + (steps < 0)
    outline = np.frombuffer(data, dtype=np.uint8)[own_level <= outline_depth].tobytes()
    return BodyScan(depth, surrogate, outline, outline_depth)


def install_old_scan() -> None:
    """Make every route of this process use old_scan (call before the server's workers fork)."""
    from lmi_serve import json_body

    json_scan.scan = old_scan
    json_body.scan = old_scan


def install_no_key_cap() -> None:
    """Make every route of this process decode as before the key cap: the scan reports no keys."""
    from lmi_serve import json_body

    scan = json_scan.scan

    def uncounted(data: bytes, *args, **kwargs) -> BodyScan:
        return dataclasses.replace(scan(data, *args, **kwargs), keys=0)

    json_scan.scan = uncounted
    json_body.scan = uncounted


# --- 1. in process -----------------------------------------------------------------------------

def measure(scan, data: bytes, outline_depth: int | None = None) -> tuple[float, int]:
    """Seconds (the best of two untraced runs), and peak bytes allocated (a run under tracemalloc,
    which slows allocation-heavy code), for one scan of `data`."""
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        scan(data, outline_depth=outline_depth)
        seconds.append(time.perf_counter() - start)
    tracemalloc.start()
    scan(data, outline_depth=outline_depth)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return min(seconds), peak


def in_process(size: int) -> None:
    mib = size / 2**20
    print(f"\n## Scan alone, {mib:.0f} MiB bodies\n")
    print("Peak memory includes the outline that /v2/repository/index keeps (up to the body's size).\n")
    print("| body | old s/MiB | new s/MiB | old/new time | new s/MiB, outline kept | old peak MiB | "
          "new peak MiB | new peak MiB, outline kept | decode s/MiB (after the scan, GIL held) |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = {**{shape: body("/v2/repository/index", shape, size) for shape in SHAPES},
              "escaped quotes": b'["' + b'\\"' * (size // 2 - 2) + b'"]'}
    for name, data in shapes.items():
        old_s, old_peak = measure(old_scan, data)
        new_s, new_peak = measure(json_scan.scan, data)
        outline_s, outline_peak = measure(json_scan.scan, data, outline_depth=2)
        start = time.perf_counter()
        json.loads(data.decode("utf-8"))
        decode_s = time.perf_counter() - start
        print(f"| {name} | {old_s / mib:.4f} | {new_s / mib:.4f} | {old_s / new_s:.1f} | {outline_s / mib:.4f} | "
              f"{old_peak / 2**20:.0f} | {new_peak / 2**20:.1f} | {outline_peak / 2**20:.1f} | {decode_s / mib:.4f} |")


# --- 2. against servers ------------------------------------------------------------------------

def start_server(port: int, size: int, old: bool, mode: str | None = None,
                 source: str | None = None) -> subprocess.Popen:
    """This script as a server (`--serve`), with the old scan or the new (or `mode`), once /ping
    answers 200; `source`: the lmi_serve source folder to import first (a former tree)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "LMI_SERVE_", "SAGEMAKER_"))}
    if source:
        env["PYTHONPATH"] = os.pathsep.join([source, str(ROOT)])
    env["LMI_SERVE_MAX_REQUEST_BYTES"] = str(size)
    log = tempfile.NamedTemporaryFile(prefix="lmi-bench-body-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_body_scan", "--serve", mode or ("old" if old else "new"),
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"server never became healthy; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass


def against_servers(size: int, port: int) -> None:
    rows = {}
    for old in (True, False):
        proc = start_server(port, size, old)
        try:
            worker = worker_process(proc.pid)
            for route in ROUTES:
                for shape in SHAPES:
                    rows[old, route, shape] = probe(f"http://127.0.0.1:{port}", worker, route, shape, size)
        finally:
            stop_server(proc)
    print(f"\n## One {size / 2**20:.0f} MiB body at a time, a stream running on the same worker\n")
    print("| route | body | status old/new | request s old/new | stream gap s old/new | /ping s old/new | "
          "RSS growth MiB old/new |")
    print("|---|---|---|---|---|---|---|")
    for route in ROUTES:
        for shape in SHAPES:
            a, b = rows[True, route, shape], rows[False, route, shape]
            print(f"| {route} | {shape} | {a.status}/{b.status} | {a.seconds:.2f}/{b.seconds:.2f} | "
                  f"{a.stream_gap:.2f}/{b.stream_gap:.2f} | {a.ping_max:.2f}/{b.ping_max:.2f} | "
                  f"{a.rss_growth / 2**20:.0f}/{b.rss_growth / 2**20:.0f} |")


DECODE_ROUTES = ("/invocations", "/v1/chat/completions", "/generate", "/v2/models/simple/infer")


def decode_against_servers(size: int, port: int, before_src: str | None, repeat: int = 1) -> None:
    """Part 3 of the module docstring: a former tree, or the key cap ignored (before), against this tree
    (after), both servers up at once (ports `port` and `port + 1`) and probed in turn, `repeat` rounds."""
    rows, servers = {}, {}
    try:
        for offset, mode in enumerate(("nocap", "new")):
            former = before_src if mode == "nocap" else None
            proc = start_server(port + offset, size, False, "new" if former else mode, former)
            servers[mode] = (proc, worker_process(proc.pid), f"http://127.0.0.1:{port + offset}")
        cells = [(r, s) for r in DECODE_ROUTES for s in DECODE_SHAPES]
        for turn, (route, shape) in enumerate(cell for _ in range(repeat) for cell in cells):
            for mode in ("nocap", "new") if turn % 2 == 0 else ("new", "nocap"):
                _, worker, base = servers[mode]
                found = probe(base, worker, route, shape, size)
                found.notes.append(f"{os.getloadavg()[0]:.1f}")
                rows.setdefault((mode, route, shape), []).append(found)
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)
    _print_decode_table(rows, size, before_src, repeat)


def _print_decode_table(rows: dict, size: int, before_src: str | None, repeat: int) -> None:
    def median(probes, attr: str, scale: float = 1.0) -> str:
        values = [getattr(p, attr) / scale for p in probes]
        return f"{statistics.median(values):.2f}" + (f" ({max(values):.2f})" if repeat > 1 else "")

    print(f"\n## One {size / 2**20:.0f} MiB body of small values at a time, a stream running on the same worker\n")
    print(f"before: {before_src or 'this tree, its key cap ignored'}; after: this tree; both servers up, probed in "
          "turn. `keys` is 13 bytes per key, `numbers` one flat array of `0`s, `rows` rows of 16 `0`s. `idle gap`: "
          "the stream's median gap before the body; `load`: the 1-minute load average after the probes. "
          f"Medians of {repeat} (the largest in brackets).\n")
    print("| route | body | status before/after | request s before/after | stream gap s before/after | "
          "idle gap s before/after | /ping s before/after | RSS peak growth MiB before/after | load before/after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for route in DECODE_ROUTES:
        for shape in DECODE_SHAPES:
            a, b = rows["nocap", route, shape], rows["new", route, shape]
            cells = [f"{'/'.join(sorted({str(p.status) for p in a}))}/{'/'.join(sorted({str(p.status) for p in b}))}"]
            cells += [f"{median(a, attr)} / {median(b, attr)}"
                      for attr in ("seconds", "stream_gap", "idle_gap", "ping_max")]
            cells.append(f"{max(p.rss_growth for p in a) / 2**20:.0f} / {max(p.rss_growth for p in b) / 2**20:.0f}")
            cells.append(f"{','.join(p.notes[-1] for p in a)} / {','.join(p.notes[-1] for p in b)}")
            print(f"| {route} | {shape} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=16 * 2**20, help="body size and server body limit (16 MiB)")
    parser.add_argument("--port", type=int, default=8397)
    parser.add_argument("--skip-servers", action="store_true", help="only the in-process figures")
    parser.add_argument("--decode", action="store_true",
                        help="only the decoder's shapes, before and after (part 3)")
    parser.add_argument("--before-src", help="with --decode: the lmi_serve source folder of the tree to compare with")
    parser.add_argument("--repeat", type=int, default=1, help="with --decode: rounds of probes (medians reported)")
    parser.add_argument("--serve", choices=("old", "new", "nocap"), help=argparse.SUPPRESS)  # this script as a server
    args = parser.parse_args()
    if args.serve:
        if args.serve == "old":
            install_old_scan()
        elif args.serve == "nocap":
            install_no_key_cap()
        from lmi_serve.__main__ import main as serve

        return serve(["--port", str(args.port)])
    if args.decode:
        print(f"# Decoding bodies of small values, before against after\n\nCPU: {cpu_summary()}; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        decode_against_servers(args.size, args.port, args.before_src, args.repeat)
        return 0
    print(f"# Body scan, old (regex + numpy) against new (json_scan)\n\nCPU: {cpu_summary()}")
    in_process(args.size)
    if not args.skip_servers:
        against_servers(args.size, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
