"""The gap workload (`scripts/bench --workload gaps`): how long a running stream stalls while long
prompts join (and, with --beam, while beam searches run).

Per system (and per --prefill-budget value, which sets option.max_rolling_batch_prefill_tokens):
--clients streaming clients (default 32) run the sweep's ordinary requests (new prompts, forced
lengths) in a closed loop for --duration seconds; every --long-every seconds a --long-tokens-token
prompt (default 2,000) joins as a streaming request of 16 tokens; with --beam, a non-streaming LMI
request with parameters.num_beams=4 (do_sample=false, 32 tokens) runs, the next one --long-every
seconds after the last one ended. Reported: the ordinary streams' ITL p50/p99 and max (the longest
gap between two tokens of a stream; target <= 1 s), the long prompts' TTFT, the beam requests'
latency, tok/s of the ordinary streams.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from pathlib import Path

from .clients import beam_one, stream_one, timed_loop
from .common import ROLLING_SYSTEMS, ModelSource, log
from .monitor import Monitor
from .report import fmt, server_log_problems, skipped_lines
from .servers import ServerSettings, Servers, warm_up
from .stats import percentile, summarize
from .workload import build_workload, long_prompt, model_folder

LONG_OUTPUT = 16
BEAM_OUTPUT = 32
NUM_BEAMS = 4


class Prompts:
    """Thread-safe source of new ordinary prompts and new long prompts (none repeats in a run)."""

    def __init__(self, tokenizer, workload, long_tokens: int):
        self.tokenizer, self.workload, self.long_tokens = tokenizer, workload, long_tokens
        self._ordinary, self._long = itertools.count(), itertools.count()
        self._lock = threading.Lock()

    def ordinary(self) -> tuple[str, int]:
        with self._lock:
            k = next(self._ordinary)
        _, prompt, n = self.workload.request(k)
        return prompt, n

    def long(self) -> str:
        with self._lock:
            k = next(self._long)
        return long_prompt(self.tokenizer, k, self.long_tokens)


def every(interval: float, deadline: float, action, first: float) -> list[threading.Thread]:
    """Start `action` in its own thread at `first` s from now and every `interval` s until `deadline`."""
    threads, due = [], time.perf_counter() + first
    while due < deadline:
        time.sleep(max(0.0, due - time.perf_counter()))
        thread = threading.Thread(target=action, daemon=True)
        thread.start()
        threads.append(thread)
        due += interval
    return threads


def gap_point(name: str, server, prompts: Prompts, args, budget: int | None) -> dict:
    import requests

    url = server.url("/invocations")
    longs, beams, lock = [], [], threading.Lock()
    long_texts = [prompts.long() for _ in range(int(args.duration / args.long_every) + 1)]

    def send_long() -> None:
        with lock:
            text = long_texts.pop() if long_texts else prompts.long()
        rec = stream_one(requests.Session(), url, text, LONG_OUTPUT)
        with lock:
            longs.append(rec)

    def beam_loop(deadline: float) -> None:
        session = requests.Session()
        time.sleep(args.long_every / 2)
        while time.perf_counter() < deadline:
            prompt, _ = prompts.ordinary()
            beams.append(beam_one(session, url, prompt, BEAM_OUTPUT, NUM_BEAMS))
            time.sleep(args.long_every)

    with Monitor(server.proc.pid) as mon:
        result: dict = {}
        loop = threading.Thread(target=lambda: result.update(zip(("records", "wall"), timed_loop(
            stream_one, url, prompts.ordinary, args.clients, args.duration))), daemon=True)
        deadline = time.perf_counter() + args.duration
        loop.start()
        helpers = [threading.Thread(target=beam_loop, args=(deadline,), daemon=True)] if args.beam else []
        for thread in helpers:
            thread.start()
        helpers += every(args.long_every, deadline, send_long, first=args.long_every / 2)
        for thread in [loop, *helpers]:
            thread.join()
    if server.proc.poll() is not None:
        raise RuntimeError(f"{name} server died (rc {server.proc.returncode}):\n{server.output()[-3000:]}")
    row = summarize(name, args.clients, result["records"], result["wall"],
                    {"peak_rss_mib": mon.peak_rss / 2**20, "bg_cpu": mon.bg_cpu_percent, "budget": budget})
    long_ttft = [r["ttft"] for r in longs if r["ok"] and r.get("ttft") is not None]
    beam_e2e = [r["e2e"] for r in beams if r["ok"]]
    row.update(long_n=len(longs), long_errors=sum(1 for r in longs if not r["ok"]),
               long_ttft_p50=percentile(long_ttft, 50), long_ttft_max=max(long_ttft, default=None),
               beam_n=len(beams), beam_errors=sum(1 for r in beams if not r["ok"]),
               beam_p50=percentile(beam_e2e, 50), beam_max=max(beam_e2e, default=None),
               error_samples=row["error_samples"] + sorted({str(r["error"])[:200] for r in longs + beams
                                                            if not r["ok"]})[:2])
    log(f"{name} (budget {budget or 'default'}): max gap {fmt(row['itl_max'])} s, ITL p99 "
        f"{fmt(row['itl_p99'], 1000, 0)} ms, long TTFT p50 {fmt(row['long_ttft_p50'])} s, beam p50 "
        f"{fmt(row['beam_p50'])} s, {row['tok_s']:.1f} tok/s, errors {row['errors']}+{row['long_errors']}"
        f"+{row['beam_errors']}, bg CPU {row['bg_cpu']:.0f}%")
    return row


def render(rows: list[dict]) -> str:
    head = ("| system | prefill budget | clients | reqs | err | tok/s | ITL p50 ms | ITL p99 ms | max gap s | <= 1 s "
            "| long prompts (err) | long TTFT p50 s | long TTFT max s | beams (err) | beam p50 s | beam max s "
            "| bg CPU % |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ok = "–" if r["itl_max"] is None else ("PASS" if r["itl_max"] <= 1.0 else "MISS")
        lines.append(
            f"| {r['system']} | {r['budget'] or 'default'} | {r['concurrency']} | {r['requests']} | {r['errors']} "
            f"| {r['tok_s']:.1f} | {fmt(r['itl_p50'], 1000, 0)} | {fmt(r['itl_p99'], 1000, 0)} | {fmt(r['itl_max'])} "
            f"| {ok} | {r['long_n']} ({r['long_errors']}) | {fmt(r['long_ttft_p50'])} | {fmt(r['long_ttft_max'])} "
            f"| {r['beam_n']} ({r['beam_errors']}) | {fmt(r['beam_p50'])} | {fmt(r['beam_max'])} "
            f"| {r['bg_cpu']:.0f} |")
    return "\n".join(lines)


def run_gaps(args, source: ModelSource) -> tuple[str, list[dict]]:
    from transformers import AutoTokenizer

    t_begin = time.monotonic()
    systems = [s for s in args.systems if s in ROLLING_SYSTEMS]
    tokenizer = AutoTokenizer.from_pretrained(model_folder(source))
    # enough ordinary prompts for every client to send a new one at least every second
    workload = build_workload(tokenizer, max(256, int(args.clients * args.duration)), args.prompt_len,
                              args.output_len)
    prompts = Prompts(tokenizer, workload, args.long_tokens)
    rows, skipped, logs = [], {}, {}
    for budget in args.prefill_budget:
        settings = ServerSettings(max_rolling=args.max_rolling_batch_size, prefill_budget=budget)
        workdir = Path(tempfile.mkdtemp(prefix="lmi-bench-gaps-"))
        servers = Servers(workdir, systems, settings, source)
        try:
            servers.wait()
            for name, server in list(servers.servers.items()):
                try:
                    warm_up(name, server, workload.window(len(workload.prompts) - 2, 2), None)
                except RuntimeError as exc:
                    servers.drop(name, f"warm-up failed: {str(exc)[:300]}")
            for name, server in servers.servers.items():
                rows.append(gap_point(name, server, prompts, args, budget))
            logs.update({f"{name} (budget {budget or 'default'})": s.output() for name, s in servers.servers.items()})
        finally:
            servers.stop()
        skipped.update({f"{name} (budget {budget or 'default'})": why for name, why in servers.skipped.items()})
    ignored = sorted(set(args.systems) - set(systems))
    out = ["## lmi-serve benchmark (gap workload)", "",
           f"Model {source.describe()}. {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; total run "
           f"{time.monotonic() - t_begin:.0f} s. {args.clients} streaming clients for {args.duration:.0f} s per system "
           f"(prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-"
           f"{args.output_len[1]} forced); a {args.long_tokens}-token prompt ({LONG_OUTPUT} output tokens) joins every "
           f"{args.long_every:.0f} s" + (f"; num_beams={NUM_BEAMS} requests ({BEAM_OUTPUT} tokens) one after another, "
                                         f"{args.long_every:.0f} s apart" if args.beam else "") + ".", "",
           render(rows), *skipped_lines(skipped), "",
           "Notes:",
           "- max gap = the longest time between two tokens of one ordinary stream (pooled ITL max); target <= 1 s "
           "at 32 clients while long prompts join and beams run. ITL and tok/s count the ordinary streams only.",
           "- a row's prefill budget is option.max_rolling_batch_prefill_tokens (default: the server's own)."]
    out += [f"- {name}: not a rolling server, not run in this workload" for name in ignored]
    out += [f"- {r['system']} errors: " + " | ".join(r["error_samples"]) for r in rows if r["error_samples"]]
    out += server_log_problems(logs)
    out += [f"- {name}: {line.strip()}" for name, text in logs.items() for line in text.splitlines()
            if "Step pace:" in line]  # what the engine measured here (engine/pace.py)
    return "\n".join(out), rows
