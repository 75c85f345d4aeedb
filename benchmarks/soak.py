"""Soak: a bounded closed-loop load over every dialect, then the figures that say whether the server
held up: errors by kind, the worker's RSS and thread count (start / max / end), rows left running.

    scripts/soak [--minutes N] [--concurrency C] [--url URL --pid PID] [--json FILE]

Without --url it starts the default server itself (as scripts/serve does). C client threads each
send, back to back, requests drawn from a fixed mix (MIX): LMI /invocations (whole and streamed),
OpenAI completions and chat (whole and streamed), embeddings, TGI /generate and /generate_stream,
Triton /infer, /generate and /generate_stream, a long prompt (chunked prefill), streams the client
closes after a few frames (cancellations) and bad requests. Every answer is classified:
- ok: a good request answered 200 in its route's shape (a stream: every frame JSON, no error frame);
- expected client error: a bad request answered 4xx with a JSON body;
- cancelled: a stream closed by the client after its first frames;
- unexpected: anything else (5xx, a 4xx for a good request, a wrong shape, a 2xx for a bad one, a
  connection error, a timeout), counted by kind.
Phases: warm-up (the mix for --warmup-minutes, default a fifth of the run, at most 2 minutes),
idle until no row runs and a few seconds more, sample "start"; the load for --minutes (RSS and
threads sampled every --sample-seconds, "max"); idle the same way, sample "end". Rows left: the
/metrics gauges lmi_serve:num_requests_running + num_requests_waiting once the idle wait ends.
Exit status 1 when an unexpected answer occurred or rows are left, else 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

TEXT = "smollm2-135m-instruct"
EMBEDDING = "all-minilm-l6-v2"
TIMEOUT = 120  # seconds to connect and between reads; past it an answer counts as a timeout
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,", "Explain gravity in one sentence:",
           "Japanese words: 東京, 大阪,", "Emoji list: 🚀🎉", "def fibonacci(n):", "Translate 'good morning' to Spanish:"]
WORDS = "apple river stone cloud market silver garden window bridge forest engine letter candle mountain ocean".split()


@dataclass
class Outcome:
    kind: str  # ok | expected_4xx | cancelled | unexpected
    detail: str = ""  # the unexpected kind: "503 /generate", "shape /v1/chat/completions", ...


# -- requests ---------------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return rng.choice(PROMPTS)


def _tokens(rng: random.Random) -> int:
    return rng.randint(1, 16)


def _frames(response: requests.Response, limit: int | None = None):
    """The JSON frames of an SSE (`data: ...`) or JSON-lines stream; `[DONE]` ends it."""
    count = 0
    for line in response.iter_lines():
        if not line:
            continue
        text = line.decode("utf-8")
        if text.startswith(":") or text.startswith("event:"):
            continue
        if text.startswith("data:"):
            text = text[5:].strip()
        if text == "[DONE]":
            return
        yield json.loads(text)
        count += 1
        if limit is not None and count >= limit:
            return


def _error_frame(frame: dict) -> bool:
    return isinstance(frame, dict) and ("error" in frame or frame.get("code") not in (None, 200))


@dataclass(frozen=True)
class Op:
    name: str
    path: str
    body: object  # a function rng -> JSON body, or bytes for a raw body
    check: object  # a function (response JSON) -> bool for a whole answer; None for a stream
    stream: bool = False
    bad: bool = False  # a bad request: a 4xx is the right answer
    cancel_after: int = 0  # close the stream after this many frames


def _invocations(rng):
    return {"inputs": _prompt(rng), "parameters": {"max_new_tokens": _tokens(rng)}}


def _long_prompt(rng):
    words = " ".join(rng.choice(WORDS) for _ in range(1500))
    return {"inputs": words, "parameters": {"max_new_tokens": 1}}


def _completions(stream):
    return lambda rng: {"model": TEXT, "prompt": _prompt(rng), "max_tokens": _tokens(rng), "stream": stream}


def _chat(stream):
    return lambda rng: {"model": TEXT, "messages": [{"role": "user", "content": _prompt(rng)}],
                        "max_tokens": _tokens(rng), "stream": stream}


def _tgi(rng):
    return {"inputs": _prompt(rng), "parameters": {"max_new_tokens": _tokens(rng)}}


def _triton_infer(rng):
    return {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [_prompt(rng)]},
                       {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [_tokens(rng)]}]}


def _triton_generate(rng):
    return {"text_input": _prompt(rng), "max_tokens": _tokens(rng)}


def _texts(body, key):
    return isinstance(body, dict) and isinstance(body.get(key), str)


def _choices(body):
    return isinstance(body, dict) and bool(body.get("choices"))


MIX: list[tuple[Op, int]] = [
    (Op("lmi", "/invocations", _invocations, lambda b: _texts(b, "generated_text")), 8),
    (Op("lmi stream", "/invocations", lambda rng: {**_invocations(rng), "stream": True}, None, stream=True), 4),
    (Op("lmi long prompt", "/invocations", _long_prompt, lambda b: _texts(b, "generated_text")), 1),
    (Op("openai completions", "/v1/completions", _completions(False), _choices), 6),
    (Op("openai completions stream", "/v1/completions", _completions(True), None, stream=True), 4),
    (Op("openai chat", "/v1/chat/completions", _chat(False), _choices), 6),
    (Op("openai chat stream", "/v1/chat/completions", _chat(True), None, stream=True), 4),
    (Op("openai embeddings", "/v1/embeddings", lambda rng: {"model": EMBEDDING, "input": _prompt(rng)},
        lambda b: isinstance(b, dict) and bool(b.get("data")) and bool(b["data"][0].get("embedding"))), 3),
    (Op("tgi generate", "/generate", _tgi, lambda b: _texts(b, "generated_text")), 6),
    (Op("tgi generate_stream", "/generate_stream", _tgi, None, stream=True), 4),
    (Op("triton infer", f"/v2/models/{TEXT}/infer", _triton_infer,
        lambda b: isinstance(b, dict) and any(o.get("name") == "text_output" for o in b.get("outputs", []))), 5),
    (Op("triton generate", f"/v2/models/{TEXT}/generate", _triton_generate, lambda b: _texts(b, "text_output")), 5),
    (Op("triton generate_stream", f"/v2/models/{TEXT}/generate_stream", _triton_generate, None, stream=True), 3),
    # Cancellations: the client closes the stream after its first frames; the engine drops the row.
    (Op("cancel openai chat stream", "/v1/chat/completions",
        lambda rng: {**_chat(True)(rng), "max_tokens": 200}, None, stream=True, cancel_after=2), 3),
    (Op("cancel tgi stream", "/generate_stream", lambda rng: {"inputs": _prompt(rng), "parameters": {"max_new_tokens": 200}},
        None, stream=True, cancel_after=2), 2),
    (Op("cancel triton stream", f"/v2/models/{TEXT}/generate_stream",
        lambda rng: {"text_input": _prompt(rng), "max_tokens": 200}, None, stream=True, cancel_after=2), 2),
    # Bad requests: each must get a JSON 4xx in its dialect.
    (Op("bad lmi json", "/invocations", lambda rng: b'{"inputs": ', None, bad=True), 1),
    (Op("bad lmi parameter", "/invocations", lambda rng: {"inputs": "Hi", "parameters": {"max_new_tokens": -3}},
        None, bad=True), 1),
    (Op("bad openai max_tokens", "/v1/completions", lambda rng: {"model": TEXT, "prompt": "Hi", "max_tokens": "x"},
        None, bad=True), 1),
    (Op("bad openai messages", "/v1/chat/completions", lambda rng: {"model": TEXT, "messages": []}, None, bad=True), 1),
    (Op("bad tgi inputs", "/generate", lambda rng: {"parameters": {"max_new_tokens": 2}}, None, bad=True), 1),
    (Op("bad triton tensor", f"/v2/models/{TEXT}/infer",
        lambda rng: {"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["Hi"]}]},
        None, bad=True), 1),
    (Op("bad triton model", "/v2/models/no-such-model/generate", lambda rng: {"text_input": "Hi"}, None, bad=True), 1),
]


def send(session: requests.Session, base: str, op: Op, rng: random.Random) -> Outcome:
    """One request of `op`, classified."""
    body = op.body(rng)
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    try:
        with session.post(base + op.path, timeout=TIMEOUT, stream=op.stream, **kwargs) as response:
            return _classify(op, response)
    except requests.Timeout:
        return Outcome("unexpected", f"timeout {op.name}")
    except requests.ConnectionError as exc:
        return Outcome("unexpected", f"connection error {op.name}: {type(exc).__name__}")
    except (ValueError, UnicodeDecodeError):  # a body or frame that is not JSON
        return Outcome("unexpected", f"not JSON {op.name}")
    except requests.RequestException as exc:
        return Outcome("unexpected", f"{type(exc).__name__} {op.name}")


def _classify(op: Op, response: requests.Response) -> Outcome:
    status = response.status_code
    if op.bad:
        if 400 <= status < 500:
            response.json()  # ValueError (not JSON) is unexpected
            return Outcome("expected_4xx")
        return Outcome("unexpected", f"{status} for bad request {op.name}")
    if status != 200:
        return Outcome("unexpected", f"{status} {op.name}")
    if not op.stream:
        return Outcome("ok") if op.check(response.json()) else Outcome("unexpected", f"shape {op.name}")
    frames = list(_frames(response, op.cancel_after or None))
    if not frames or any(_error_frame(f) for f in frames):
        return Outcome("unexpected", f"stream {op.name}: {'error frame' if frames else 'no frames'}")
    return Outcome("cancelled" if op.cancel_after else "ok")


# -- the load ----------------------------------------------------------------------------------------
@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    unexpected: collections.Counter = field(default_factory=collections.Counter)
    per_op: collections.Counter = field(default_factory=collections.Counter)
    seconds: collections.Counter = field(default_factory=collections.Counter)  # per op, summed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Op, outcome: Outcome, seconds: float) -> None:
        with self.lock:
            self.outcomes[outcome.kind] += 1
            self.per_op[op.name] += 1
            self.seconds[op.name] += seconds
            if outcome.kind == "unexpected":
                self.unexpected[outcome.detail] += 1


def deck(rng: random.Random):
    """The mix's ops, each as often as its weight, shuffled, over and over; a client's first two are a
    bad request and a cancelled stream, so even a short run has both."""
    yield rng.choice([op for op, _ in MIX if op.bad])
    yield rng.choice([op for op, _ in MIX if op.cancel_after])
    cards = [op for op, weight in MIX for _ in range(weight)]
    while True:
        rng.shuffle(cards)
        yield from cards


def load(base: str, concurrency: int, seconds: float, seed: int, tally: Tally, progress: bool = False) -> None:
    """`concurrency` client threads sending the mix back to back for `seconds`; with `progress`, a line
    of counts about every minute."""
    stop_at = time.monotonic() + seconds

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        ops = deck(rng)
        with requests.Session() as session:
            while time.monotonic() < stop_at:
                op = next(ops)
                started = time.monotonic()
                outcome = send(session, base, op, rng)
                tally.add(op, outcome, time.monotonic() - started)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    shown = time.monotonic()
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.5)
        if progress and time.monotonic() - shown >= 60:
            shown = time.monotonic()
            with tally.lock:
                print(f"[soak] {time.strftime('%H:%M:%S')}: {sum(tally.outcomes.values())} answers, "
                      f"unexpected {tally.outcomes['unexpected']} {dict(tally.unexpected) or ''}", flush=True)


# -- what is measured --------------------------------------------------------------------------------
def proc_status(pid: int) -> tuple[float, int] | None:
    """(VmRSS MiB, Threads) of a process from /proc, or None when it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


def worker_pid(master: int) -> int | None:
    """The gunicorn master's one worker (the model process)."""
    try:
        children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


class Sampler:
    """Samples the worker's RSS and threads every `every` seconds in the background; `max` over the run."""

    def __init__(self, pid: int | None, every: float):
        self.pid, self.every = pid, every
        self.max_rss, self.max_threads, self.samples = 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> tuple[float, int] | None:
        now = proc_status(self.pid) if self.pid else None
        if now:
            self.max_rss, self.max_threads = max(self.max_rss, now[0]), max(self.max_threads, now[1])
            self.samples += 1
        return now

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rows_in_flight(base: str) -> float:
    """lmi_serve:num_requests_running + num_requests_waiting, summed over models, from GET /metrics."""
    text = requests.get(base + "/metrics", timeout=TIMEOUT).text
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("lmi_serve:num_requests_running", "lmi_serve:num_requests_waiting"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settle(base: str, idle_seconds: float, deadline: float = 120) -> float:
    """Wait until no row runs or waits (at most `deadline` s), then `idle_seconds` more; the rows left."""
    end = time.monotonic() + deadline
    rows = rows_in_flight(base)
    while rows and time.monotonic() < end:
        time.sleep(0.5)
        rows = rows_in_flight(base)
    time.sleep(idle_seconds)
    return rows_in_flight(base)


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the measured load (default 5)")
    parser.add_argument("--concurrency", type=int, default=32, help="client threads (default 32)")
    parser.add_argument("--warmup-minutes", type=float, help="warm-up load before 'start' (default: a fifth of "
                        "--minutes, at most 2)")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle before the start and end samples")
    parser.add_argument("--sample-seconds", type=float, default=2.0, help="RSS / thread sampling period")
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--pid", type=int, help="with --url: the gunicorn master's pid, for RSS and threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    return parser.parse_args(argv)


def report(args, figures: dict) -> None:
    print(f"\nsoak: {args.minutes:g} min at concurrency {args.concurrency} ({figures['cpu']}, {os.cpu_count()} CPUs)")
    print(f"requests: {figures['requests']} ({figures['requests_per_second']:.1f}/s); outcomes: "
          + ", ".join(f"{k} {v}" for k, v in sorted(figures["outcomes"].items())))
    print(f"unexpected: {figures['unexpected']}" + (" (by kind:)" if figures["unexpected"] else ""))
    for detail, count in sorted(figures["unexpected_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:6d}  {detail}")
    rss, threads = figures["rss_mib"], figures["threads"]
    if rss["start"] is not None:
        print(f"worker RSS MiB: start {rss['start']:.0f}, max {rss['max']:.0f}, end {rss['end']:.0f} "
              f"(drift {100 * rss['drift']:+.1f}%)")
        print(f"worker threads: start {threads['start']}, max {threads['max']}, end {threads['end']}")
    print(f"rows left running or waiting: {figures['rows_left']:g}")
    print("per request kind: count, mean seconds")
    for name, (count, mean) in sorted(figures["per_op"].items()):
        print(f"  {count:6d}  {mean:6.2f} s  {name}")


def run(args, base: str, master: int | None) -> dict:
    pid = worker_pid(master) if master else None
    warmup = args.warmup_minutes if args.warmup_minutes is not None else min(2.0, args.minutes / 5)
    print(f"[soak] warm-up {60 * warmup:.0f} s at concurrency {args.concurrency}", flush=True)
    load(base, args.concurrency, 60 * warmup, args.seed + 1, Tally())
    settle(base, args.idle_seconds)
    start = proc_status(pid) if pid else None
    tally = Tally()
    print(f"[soak] load {60 * args.minutes:.0f} s; worker at start: {start}", flush=True)
    began = time.monotonic()
    with Sampler(pid, args.sample_seconds) as sampler:
        load(base, args.concurrency, 60 * args.minutes, args.seed, tally, progress=True)
        elapsed = time.monotonic() - began
        rows_left = settle(base, args.idle_seconds)
        end = sampler.sample()
    requests_done = sum(tally.outcomes.values())
    return {
        "cpu": cpu_summary(), "minutes": args.minutes, "concurrency": args.concurrency,
        "requests": requests_done, "requests_per_second": requests_done / elapsed,
        "outcomes": dict(tally.outcomes), "unexpected": tally.outcomes["unexpected"],
        "unexpected_by_kind": dict(tally.unexpected), "per_op": {name: (count, tally.seconds[name] / count) for name, count in tally.per_op.items()}, "rows_left": rows_left,
        "rss_mib": {"start": start and start[0], "max": sampler.max_rss if pid else None, "end": end and end[0],
                    "drift": (end[0] / start[0] - 1) if start and end else None},
        "threads": {"start": start and start[1], "max": sampler.max_threads if pid else None, "end": end and end[1]},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started (finally)
    server = None
    if args.url:
        base, master = args.url.rstrip("/"), args.pid
    else:
        from benchmarks.benchmark.suite import helper
        ServerProcess = helper("server_process").ServerProcess

        server = ServerProcess()
        print(f"[soak] starting the server on {server.base} (log {server.log.name})", flush=True)
        server.wait_for_ping(timeout=600)
        base, master = server.base, server.proc.pid
    try:
        figures = run(args, base, master)
    finally:
        if server is not None:
            server.stop()
    report(args, figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 1 if figures["unexpected"] or figures["rows_left"] else 0


if __name__ == "__main__":
    sys.exit(main())
