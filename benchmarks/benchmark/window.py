"""Closed-loop streaming clients measured over a fixed window of time (benchmarks/bench_cpu_scaling.py).

`clients` threads each send a streaming LMI request (`POST /invocations`, jsonlines, forced length), and the
next as soon as it ends. Every token line is timestamped on arrival; tok/s is the tokens that arrived inside
the window divided by its length, so requests in flight at either edge count for the part that fell inside,
and nothing waits for the last requests to drain (at one core a request of 200 tokens among 64 rows takes
minutes).

Steady state from the start: client i's first request asks for (i + 1) / clients of the longest output, so the
first requests end spread over time and rows join and leave throughout, as they do once a closed loop has
run a while. Without it every client would start together and, on a slow layout, the whole window would fall
inside the first requests' decode, with no prompt to prefill (a faster layout's window would hold joins: the
comparison would be skewed). The window opens once every client has its first token (the opening burst of
prefills is over) plus `settle` seconds, or at `ramp_max` at the latest.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from .stats import percentile


@dataclass
class Request:
    start: float
    times: list[float] = field(default_factory=list)  # each token line's arrival
    end: float | None = None
    done: bool = False  # the final line (generated_text) arrived
    error: str | None = None


@dataclass
class WindowResult:
    tokens: int  # token lines that arrived inside the window
    window_s: float
    ramp_s: float
    ramp_capped: bool  # the window opened at ramp_max, before every client had its first token
    finished: int  # requests that ended inside the window
    errors: list[str]
    tpot_p50_ms: float | None  # requests that ended inside the window: (last token - first) / (tokens - 1)
    ttft_p50_ms: float | None  # requests that started inside the window
    itl_p50_ms: float | None  # gaps between a stream's tokens, both inside the window
    client_cpu: float  # this process's CPU over the window, in cores (the clients' share of the machine)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


def stream(session, url: str, prompt: str, max_new_tokens: int, stop: threading.Event, rec: Request) -> None:
    """One streaming request into `rec` (visible to the caller while it runs), left (the connection closed, so
    the server cancels it) once `stop` is set."""
    payload = {"inputs": prompt, "stream": True,
               "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}}
    try:
        with session.post(url, json=payload, stream=True, timeout=(10, 600)) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            buf = b""
            for chunk in ([] if rec.error else resp.iter_content(chunk_size=None)):
                now = time.perf_counter()
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        _read_line(rec, json.loads(line), now)
                if stop.is_set():
                    break
    except Exception as exc:  # noqa: BLE001 - counted; a server stopped under a stream ends it this way too
        if not stop.is_set():
            rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()


def _read_line(rec: Request, obj: dict, now: float) -> None:
    if "token" in obj:
        rec.times.append(now)
    if "error" in obj:
        rec.error = f"stream error line: {str(obj)[:200]}"
    if "generated_text" in obj:
        rec.done = True


def drive(url: str, requests_for, clients: int, window: float, ramp_max: float, settle: float = 2.0,
          longest: int = 192) -> WindowResult:
    """`clients` closed-loop clients; `requests_for(i)` gives client i's endless (prompt, max_new_tokens) iterator.
    Returns once the window has closed and the clients have left, or 10 s after (each notices `stop` at its
    stream's next token; one still waiting then leaves when the server stops)."""
    import requests

    stop = threading.Event()
    records: list[list[Request]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        feed = requests_for(i)
        first = True
        with requests.Session() as session:
            while not stop.is_set():
                prompt, n = next(feed)
                if first:  # spread the first requests' ends (module docstring)
                    n, first = max(1, round((i + 1) / clients * longest)), False
                rec = Request(time.perf_counter())
                records[i].append(rec)
                stream(session, url, prompt, n, stop, rec)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    capped = not _wait_until(lambda: all(r and (r[0].times or r[0].end) for r in records), ramp_max)
    time.sleep(0 if capped else settle)
    opened, cpu_before = time.perf_counter(), time.process_time()
    time.sleep(window)
    closed, cpu_after = time.perf_counter(), time.process_time()
    stop.set()
    leave_by = time.perf_counter() + 10  # a client waiting for a first token notices later: the server's stop ends it
    for t in threads:
        t.join(timeout=max(0.0, leave_by - time.perf_counter()))
    every = [rec for recs in records for rec in recs]
    return summarize(every, opened, closed, opened - started, capped, (cpu_after - cpu_before) / window)


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def summarize(every: list[Request], opened: float, closed: float, ramp_s: float, capped: bool,
              client_cpu: float) -> WindowResult:
    """The window's figures from every request's timestamps (see WindowResult)."""
    inside = lambda t: opened <= t <= closed  # noqa: E731
    ended = [r for r in every if r.done and r.end is not None and inside(r.end) and len(r.times) > 1]
    tpot = [(r.times[-1] - r.times[0]) / (len(r.times) - 1) for r in ended]
    ttft = [r.times[0] - r.start for r in every if inside(r.start) and r.times]
    itl = [b - a for r in every for a, b in zip(r.times, r.times[1:]) if inside(a) and inside(b)]

    def ms(values: list[float]) -> float | None:
        value = percentile(values, 50)
        return None if value is None else round(value * 1000, 1)

    return WindowResult(tokens=sum(1 for r in every for t in r.times if inside(t)), window_s=closed - opened,
                        ramp_s=ramp_s, ramp_capped=capped, finished=len(ended),
                        errors=sorted({r.error for r in every if r.error})[:3], tpot_p50_ms=ms(tpot),
                        ttft_p50_ms=ms(ttft), itl_p50_ms=ms(itl), client_cpu=client_cpu)
