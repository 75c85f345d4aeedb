"""Large JSON bodies against a running server, watched from outside: while one body is sent, a
token stream on the same worker records its largest inter-token gap, a poller its slowest /ping,
and a sampler the worker's peak RSS. Used by benchmarks/bench_body_scan.py and
tests/integration/ops/test_body_scan.py.

Every body is valid JSON of `size` bytes exactly: a small real request of the route plus one
padding field (`zz_pad`) shaped as one long string, nesting at a given depth, many keys, or (a
DECODE_SHAPES shape, for the decoder's cost rather than the scan's) one flat array of numbers or
rows of 16 numbers (a tensor [-1, 16] sent nested).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import psutil
import requests

TEXT_MODEL = "smollm2-135m-instruct"
TENSOR_MODEL = "simple"
_SIMPLE_INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
# route -> (a small request, the deepest nesting the route accepts). The generation routes refuse
# these once the body is decoded (the padding field is unknown to LMI's and TGI's schemas, and
# chat's max_tokens is 0), so no prefill joins the batch and the stream's gaps are the body's alone.
ROUTES = {
    "/invocations": ({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, 128),
    "/v1/chat/completions": ({"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
                             128),
    "/generate": ({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, 128),
    f"/v2/models/{TENSOR_MODEL}/infer": (_SIMPLE_INFER, 100),
    "/v2/repository/index": ({"ready": True}, 100),
}
SHAPES = ("string", "deep_under", "deep_over", "keys")
DECODE_SHAPES = ("keys", "numbers", "rows")  # millions of small values: what the JSON decoder spends its time on


def body(route: str, shape: str, size: int) -> bytes:
    """`route`'s request padded to exactly `size` bytes with a `zz_pad` field of `shape`."""
    request, max_depth = ROUTES[route]
    head = json.dumps(request)[:-1].encode() + b', "zz_pad": '
    room = size - len(head) - 1  # the closing brace
    if shape == "string":
        pad = b'"' + b"x" * (room - 2) + b'"'
    elif shape in ("deep_under", "deep_over"):
        levels = max_depth - 1 + (shape == "deep_over")  # the body itself is one level
        pad = b"[" * levels + _numbers(room - 2 * levels) + b"]" * levels
    elif shape == "keys":
        pad = _keys(room)
    elif shape == "numbers":
        pad = b"[" + _numbers(room - 2) + b"]"
    elif shape == "rows":
        pad = b"[" + _rows(room - 2) + b"]"
    else:
        raise ValueError(f"unknown shape {shape!r}")
    data = head + pad + b"}"
    assert len(data) == size, (shape, len(data), size)
    return data


def _numbers(length: int) -> bytes:
    """`0,0,...,0` padded with spaces to exactly `length` bytes (at least 1)."""
    count = (length + 1) // 2
    return (b"0," * count)[:2 * count - 1].ljust(length)


def _rows(length: int) -> bytes:
    """`[0,...,0],[0,...,0],...` (16 numbers a row) padded with spaces to exactly `length` bytes."""
    row = b"[" + b",".join([b"0"] * 16) + b"]"
    return b",".join([row] * ((length + 1) // (len(row) + 1))).ljust(length)


def _keys(length: int) -> bytes:
    """An object of distinct keys (`"k0000000":0,`) padded with spaces to exactly `length` bytes."""
    count = (length - 2) // 13
    pairs = b",".join(b'"k%07d":0' % i for i in range(count))
    return (b"{" + pairs + b"}").ljust(length)


@dataclass
class Probe:
    """One body's figures."""

    route: str
    shape: str
    size: int
    status: int = 0
    error: str = ""
    seconds: float = 0.0
    stream_gap: float = 0.0  # largest inter-token gap of the stream while the body was handled
    idle_gap: float = 0.0  # median inter-token gap of the same stream before the body was sent
    ping_max: float = 0.0  # slowest /ping answer while the body was handled
    rss_growth: int = 0  # the worker's peak RSS while the body was handled, less its RSS before
    notes: list[str] = field(default_factory=list)


def worker_process(server_pid: int) -> psutil.Process:
    """The one gunicorn worker under `server_pid` (the process serving requests)."""
    children = psutil.Process(server_pid).children(recursive=True)
    if len(children) != 1:
        raise RuntimeError(f"expected one worker, found {len(children)}")
    return children[0]


class _Stream(threading.Thread):
    """A TGI token stream (SSE), its arrival times kept; ends when `stop` is set or tokens run out."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.arrivals, self.stop = base, [], threading.Event()
        self.error = ""

    def run(self) -> None:
        payload = {"inputs": "Tell me a long story about the sea.",
                   "parameters": {"max_new_tokens": 2000, "ignore_eos_token": True}}
        try:
            with requests.post(self.base + "/generate_stream", json=payload, stream=True, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith(b"data:"):
                        self.arrivals.append(time.perf_counter())
                    if self.stop.is_set():
                        break
        except requests.RequestException as exc:
            self.error = str(exc)


class _Sampler(threading.Thread):
    """Calls `sample` every `interval` s until stopped; keeps what it returns."""

    def __init__(self, sample, interval: float):
        super().__init__(daemon=True)
        self.sample, self.interval, self.values, self.stop = sample, interval, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.values.append(self.sample())
            self.stop.wait(self.interval)


def _ping(base: str) -> tuple[float, float]:
    start = time.perf_counter()
    try:
        requests.get(base + "/ping", timeout=60)
    except requests.RequestException:
        pass
    return start, time.perf_counter() - start


def _largest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The largest gap between tokens that touches [start, end]."""
    inside = [t for t in arrivals if t >= start]
    before = [t for t in arrivals if t < start][-1:]
    after_end = [t for t in inside if t > end][:1]
    times = before + [t for t in inside if t <= end] + after_end
    return max((b - a for a, b in zip(times, times[1:])), default=end - start)


def probe(base: str, worker: psutil.Process, route: str, shape: str, size: int) -> Probe:
    """Send one body while a stream runs, /ping is polled and the worker's RSS sampled."""
    result = Probe(route, shape, size)
    data = body(route, shape, size)
    stream = _Stream(base)
    stream.start()
    deadline = time.monotonic() + 60
    while len(stream.arrivals) < 3 and stream.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if len(stream.arrivals) < 3:
        raise RuntimeError(f"the stream gave no tokens: {stream.error}")
    rss = _Sampler(lambda: worker.memory_info().rss, 0.01)
    pings = _Sampler(lambda: _ping(base), 0.05)
    baseline = worker.memory_info().rss
    rss.start()
    pings.start()
    time.sleep(0.2)
    start = time.perf_counter()
    try:
        reply = requests.post(base + route, data=data, headers={"Content-Type": "application/json"}, timeout=120)
        result.status = reply.status_code
        if reply.status_code >= 400:
            result.error = reply.text[:200]
    except requests.RequestException as exc:
        result.error = str(exc)
    end = time.perf_counter()
    time.sleep(0.3)  # a gap or a slow ping that began during the body ends after it
    for sampler in (rss, pings, stream):
        sampler.stop.set()
    for sampler in (rss, pings):
        sampler.join()
    stream.join(timeout=30)
    result.seconds = end - start
    result.stream_gap = _largest_gap(stream.arrivals, start, end)
    earlier = [t for t in stream.arrivals if t < start]
    result.idle_gap = statistics.median([b - a for a, b in zip(earlier, earlier[1:])] or [0.0])
    result.ping_max = max((latency for sent, latency in pings.values if sent + latency >= start and sent <= end),
                          default=0.0)
    result.rss_growth = max(rss.values, default=baseline) - baseline
    return result
