"""What the OpenAI dialect and constrained decoding cost, side by side on one server in one run.

Systems, all streaming, closed loop, the same prompts and forced output lengths:
- lmi          POST /invocations, LMI rolling schema, JSON lines (the baseline)
- openai       POST /v1/completions, SSE chunks + usage
- openai-json  POST /v1/chat/completions with a json_schema response_format: every token of every
               row is masked by its grammar inside the rolling batch (`ignore_eos`; the grammar may
               still end a row early, so compare TPOT/ITL, not only tok/s)
Prints one row per system and concurrency, and each system's ratio to lmi.

    .venv/bin/python -m benchmarks.bench_openai [--concurrency 1,8] [--requests 16]   (after scripts/serve or scripts/test set up .venv)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import requests

from benchmarks.benchmark.clients import closed_loop, stream_one  # noqa: E402
from benchmarks.benchmark.common import DEFAULT_MODEL  # noqa: E402
from benchmarks.benchmark.stats import summarize  # noqa: E402
from benchmarks.benchmark.workload import build_workload, model_folder  # noqa: E402

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "notes": {"type": "array",
          "items": {"type": "string"}}}, "required": ["answer", "notes"]}


def sse_one(session, url: str, payload: dict, max_new_tokens: int) -> dict:
    """One OpenAI SSE stream: TTFT and gaps between content chunks; tokens from the usage chunk."""
    rec = {"ok": False, "error": None, "tokens": 0, "target": max_new_tokens, "ttft": None, "itl": [],
           "streamed": True, "start": time.perf_counter()}
    try:
        with session.post(url, json=payload, stream=True, timeout=(10, 600)) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
            last = None
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    if last is None:
                        rec["ttft"] = now - rec["start"]
                    else:
                        rec["itl"].append(now - last)
                    last = now
        rec["ok"] = rec["error"] is None and rec["tokens"] > 0
    except Exception as exc:  # noqa: BLE001 - every failure is counted
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["e2e"] = time.perf_counter() - rec["start"]
    return rec


def completions_sender(session, url, prompt, n):
    return sse_one(session, url, {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                  "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}, n)


def json_chat_sender(session, url, prompt, n):
    return sse_one(session, url, {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}, n)


SYSTEMS = {"lmi": ("/invocations", stream_one), "openai": ("/v1/completions", completions_sender),
           "openai-json": ("/v1/chat/completions", json_chat_sender)}


def start_server(port: int, *args: str, log_prefix: str = "lmi-bench-openai-", env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = ()) -> subprocess.Popen:
    """`python -m lmi_serve --port port *args` (after `wrapper`, e.g. taskset, and with `env` over this
    process's environment), returned once /ping answers 200."""
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
    proc = subprocess.Popen([*wrapper, sys.executable, "-m", "lmi_serve", "--port", str(port), *args], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


def fmt(value, scale=1.0, digits=3):
    return "-" if value is None else f"{value * scale:.{digits}g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="requests per point (default 16)")
    p.add_argument("--output-len", default="32,64")
    p.add_argument("--port", type=int, default=8391)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(DEFAULT_MODEL))
    out_range = tuple(int(x) for x in args.output_len.split(","))
    workload = build_workload(tokenizer, args.requests, (10, 120), out_range)
    proc = start_server(args.port)
    base = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        for name, (path, send) in SYSTEMS.items():  # warm-up: kernels, grammar tokenizer
            closed_loop(send, base + path, workload, 1, 1)
        for c in (int(x) for x in args.concurrency.split(",")):
            for name, (path, send) in SYSTEMS.items():
                records, wall = closed_loop(send, base + path, workload, c, args.requests)
                row = summarize(name, c, records, wall)
                rows.append(row)
                print(f"[bench] {name}@{c}: {row['tok_s']:.1f} tok/s, errors {row['errors']}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"\n## OpenAI dialect and grammar cost ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"{args.requests} requests per point, outputs {out_range[0]}-{out_range[1]} tokens, greedy)\n")
    print("| system | c | tok/s | x lmi | TTFT p50 ms | TPOT p50 ms | x lmi | ITL p50 ms | ITL p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ref = next(r for r in rows if r["system"] == "lmi" and r["concurrency"] == row["concurrency"])
        tok_ratio = row["tok_s"] / ref["tok_s"] if ref["tok_s"] else None
        tpot_ratio = row["tpot_p50"] / ref["tpot_p50"] if row["tpot_p50"] and ref["tpot_p50"] else None
        print(f"| {row['system']} | {row['concurrency']} | {row['tok_s']:.1f} | {fmt(tok_ratio)} | "
              f"{fmt(row['ttft_p50'], 1e3)} | {fmt(row['tpot_p50'], 1e3)} | {fmt(tpot_ratio)} | "
              f"{fmt(row['itl_p50'], 1e3)} | {fmt(row['itl_p99'], 1e3)} | {row['errors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
