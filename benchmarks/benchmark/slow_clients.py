"""Slow and idle client connections, and a steady stream of normal requests beside them.

`SlowSockets` keeps `count` raw connections open against a server, each in one of three kinds:
- head: sends a request's head one byte at a time,
- body: sends a whole head declaring a Content-Length, then the body one byte at a time,
- idle: connects and sends nothing.
`kinds` picks the mix (in turn). One thread drives them all: every `interval` each socket sends its
next byte (or nothing, if idle); a socket the server answered or closed is recorded (status code, or
`closed`) and replaced by a fresh one of the same kind while the pressure lasts, so `count`
connections stay open until `stop()`.

`NormalLoad` sends ordinary requests in a loop on a few threads (a /ping and a short generation in the
LMI and OpenAI dialects) and records each one's latency, or its error.
Used by benchmarks/bench_slow_clients.py and tests/integration/ops/test_slow_clients.py.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import requests

KINDS = ("head", "body", "idle")
_BODY = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
_PADDED_BODY = _BODY + b" " * 1000  # the JSON stays valid; trickled, it takes ~1000 intervals


def _script(kind: str) -> tuple[bytes, bytes]:
    """(bytes sent at once on connect, bytes sent one per interval)."""
    head = (b"POST /invocations HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    if kind == "head":
        return b"", head % len(_BODY) + _BODY
    if kind == "body":
        return head % len(_PADDED_BODY), _PADDED_BODY
    return b"", b""


@dataclass
class _Slow:
    kind: str
    sock: socket.socket
    rest: bytes
    answer: bytes = b""


@dataclass
class SlowSockets:
    """`count` slow connections to host:port, kinds in turn; see the module docstring."""

    host: str
    port: int
    count: int
    interval: float = 0.5
    kinds: tuple[str, ...] = KINDS
    outcomes: dict[str, Counter] = field(default_factory=lambda: {kind: Counter() for kind in KINDS})
    opened: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._socks: list[_Slow] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SlowSockets:
        for i in range(self.count):
            self._socks.append(self._open(self.kinds[i % len(self.kinds)]))
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop trickling; the sockets still open are closed and counted as `open at the end`."""
        self._stop.set()
        self._thread.join()
        for slow in self._socks:
            self.outcomes[slow.kind]["open at the end"] += 1
            slow.sock.close()

    def _open(self, kind: str) -> _Slow:
        sock = socket.create_connection((self.host, self.port), timeout=30)
        first, rest = _script(kind)
        if first:
            sock.sendall(first)
        sock.setblocking(False)
        self.opened += 1
        return _Slow(kind, sock, rest)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for i, slow in enumerate(self._socks):
                outcome = self._step(slow)
                if outcome is not None:
                    self.outcomes[slow.kind][outcome] += 1
                    slow.sock.close()
                    if not self._stop.is_set():
                        self._socks[i] = self._open(slow.kind)

    @staticmethod
    def _step(slow: _Slow) -> str | None:
        """Read what the server sent (an answer or its close), else send the next byte. Returns the
        outcome once the server answered or closed: the status code, or `closed`."""
        try:
            while chunk := slow.sock.recv(65536):
                slow.answer += chunk
            return _status(slow.answer) or "closed"  # EOF
        except BlockingIOError:
            pass
        except OSError:
            return _status(slow.answer) or "closed"
        if slow.answer:
            return _status(slow.answer) or "partial answer"
        if slow.rest:
            try:
                slow.sock.send(slow.rest[:1])
                slow.rest = slow.rest[1:]
            except BlockingIOError:
                pass
            except OSError:
                return "closed"
        return None


def _status(answer: bytes) -> str | None:
    parts = answer.split(b" ", 2)
    return parts[1].decode("latin-1") if len(parts) > 1 and answer.startswith(b"HTTP/") else None


NORMAL_REQUESTS = {
    "ping": ("GET", "/ping", None),
    "lmi": ("POST", "/invocations", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}),
    "openai": ("POST", "/v1/completions", {"model": "any", "prompt": "Hello", "max_tokens": 4}),
}


@dataclass
class NormalLoad:
    """`clients` threads, each sending the NORMAL_REQUESTS in turn on a fresh connection until stop(),
    and one more sending only /ping every `ping_every` seconds (a latency the model's CPU use does not
    dominate): every request's latency (seconds) by name, and the failures (name, error) without a 200."""

    base: str
    clients: int = 2
    timeout: float = 30.0
    ping_every: float = 0.05
    latencies: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in NORMAL_REQUESTS})
    failures: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        names = list(NORMAL_REQUESTS)
        self._threads = [threading.Thread(target=self._run, args=(names[i:] + names[:i], 0.0), daemon=True)
                         for i in range(self.clients)]
        self._threads.append(threading.Thread(target=self._run, args=(["ping"], self.ping_every), daemon=True))

    def start(self) -> NormalLoad:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def one(self, name: str) -> float:
        """Send one request; its latency, or raise with what went wrong."""
        method, path, body = NORMAL_REQUESTS[name]
        start = time.perf_counter()
        # A fresh connection each time, as a client behind a load balancer often has: the server's
        # accept path is what slow sockets crowd.
        response = requests.request(method, self.base + path, json=body, timeout=self.timeout,
                                    headers={"Connection": "close"})
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return elapsed

    def _run(self, names: list[str], pause: float) -> None:
        i = 0
        while not self._stop.wait(pause):
            name = names[i % len(names)]
            i += 1
            try:
                self.latencies[name].append(self.one(name))
            except Exception as error:  # recorded, the load goes on
                self.failures.append((name, f"{type(error).__name__}: {error}"[:300]))

    def all_latencies(self) -> list[float]:
        return sorted(x for values in self.latencies.values() for x in values)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (nan when empty)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]
