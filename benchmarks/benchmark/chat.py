"""The chat workload (`scripts/bench --workload chat`): what a prefix cache saves.

Every request is an OpenAI /v1/chat/completions streaming request with the same ~200-token system
prompt (workload.SYSTEM_PROMPT) and its own short user message (new for every request of the run, so
only the system prompt is shared), greedy, forced output lengths (`max_tokens` + `ignore_eos`).
Systems: our rolling servers (rolling-no-prefix, rolling, ...) and llama-server, whose prompt cache is on
here (`--cache-prompt`, `cache_prompt: true`): that is llama.cpp's prefix cache. Reports TTFT
p50/p99, ITL, tok/s per system and concurrency, and the ratio "chat TTFT p50 at 16 clients:
rolling-no-prefix / rolling" (the prefix cache is on by default; target >= 3x).
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from pathlib import Path

from .clients import openai_sender
from .common import ALL_SYSTEMS, LLAMA_SYSTEMS, ModelSource, log
from .points import Runner, http_point
from .report import find, render_table, retried_lines, server_log_problems, skipped_lines
from .servers import ServerSettings, Servers, warm_up
from .workload import SYSTEM_PROMPT, build_chat_workload, model_folder, system_prompt_tokens

ROUTE = "/v1/chat/completions"
CHAT_SYSTEMS = set(ALL_SYSTEMS) - {"dynamic", "cb", "static", "vllm-cpu", "vllm-cpu-bf16"}
LLAMA_NOTE = ["- llama-server runs with its prompt cache on (`--cache-prompt`, `cache_prompt: true`): llama.cpp's "
              "prefix cache. It is per slot (-np slots): the first request on each slot prefills the whole system "
              "prompt (seen in its log), so at c clients up to c requests pay the full prompt once."]


def chat_sender(name: str):
    extra = {"cache_prompt": True} if name in LLAMA_SYSTEMS else None
    return openai_sender("chat", SYSTEM_PROMPT, extra)


def ttft_ratio(rows: list[dict], concurrency: int) -> str:
    """The target line: TTFT p50 without / with prefix caching at `concurrency` clients."""
    label = f"chat TTFT p50 at {concurrency} clients: rolling-no-prefix / rolling"
    base, cached = find(rows, "rolling-no-prefix", concurrency), find(rows, "rolling", concurrency)
    if not base or not cached or not base.get("ttft_p50") or not cached.get("ttft_p50"):
        return f"- {label}: not measured"
    value = base["ttft_p50"] / cached["ttft_p50"]
    mark = "PASS" if value >= 3.0 else "MISS"
    return (f"- {label}: {base['ttft_p50']:.2f} / {cached['ttft_p50']:.2f} s = **{value:.2f}x** "
            f"(target >= 3x) {mark}")


def run_chat(args, source: ModelSource) -> tuple[str, list[dict]]:
    from transformers import AutoTokenizer

    t_begin = time.monotonic()
    systems = [s for s in args.systems if s in CHAT_SYSTEMS]
    dropped = sorted(set(args.systems) - set(systems))
    tokenizer = AutoTokenizer.from_pretrained(model_folder(source))
    sizes = {c: max(c * args.requests_per_client, args.min_requests) if not args.num_prompts else args.num_prompts
             for c in args.concurrency}
    total = sum(sizes.values())
    workload = build_chat_workload(tokenizer, total + 2, args.output_len)
    ctx = max(workload.prompt_tokens) + args.output_len[1] + 64
    settings = ServerSettings(max_rolling=args.max_rolling_batch_size, llama_slots=max(args.concurrency),
                              llama_ctx_per_slot=-(-ctx // 256) * 256, llama_threads=args.threads,
                              llama_prompt_cache=True)
    workdir = Path(tempfile.mkdtemp(prefix="lmi-bench-chat-"))
    servers = Servers(workdir, systems, settings, source)
    runner = Runner(args.quiet_wait, args.quiet_threshold, args.noisy, args.retries)
    rows: list[dict] = []
    notes: list[str] = [f"{name}: not a chat system (only our rolling servers and llama-server)" for name in dropped]
    try:
        servers.wait()
        for name, server in list(servers.servers.items()):
            try:  # the warm-up's own user messages (the last window): they also put the system prompt in a cache
                warm_up(name, server, workload.window(total, 2), None, chat_sender(name), ROUTE)
            except RuntimeError as exc:
                servers.drop(name, f"warm-up failed: {str(exc)[:300]}")
        offset = 0
        try:
            for c in args.concurrency:
                window = workload.window(offset, sizes[c])
                offset += sizes[c]
                for name, server in servers.servers.items():
                    run = functools.partial(http_point, name, server, chat_sender(name), ROUTE, window, c, sizes[c])
                    rows.append(runner.measure(f"{name}@{c}", run))
        except Exception as exc:  # noqa: BLE001 - keep what was measured and say why it stopped
            notes.append(f"CHAT RUN ABORTED: {type(exc).__name__}: {str(exc)[-2000:]}")
            log(f"chat run aborted: {type(exc).__name__}: {str(exc)[-2000:]}")
        server_logs = {name: s.output() for name, s in servers.servers.items()}
    finally:
        servers.stop()

    order = {s: i for i, s in enumerate(ALL_SYSTEMS)}
    rows.sort(key=lambda r: (order[r["system"]], r["concurrency"]))
    ttft_at = args.ttft_concurrency if args.ttft_concurrency in args.concurrency else max(args.concurrency)
    out = ["## lmi-serve benchmark (chat workload)", "",
           f"Model {source.describe()}. {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; total run "
           f"{time.monotonic() - t_begin:.0f} s. Streaming {ROUTE}, one shared system prompt of "
           f"{system_prompt_tokens(tokenizer)} tokens + a different user message per request (whole templated "
           f"prompt {min(workload.prompt_tokens)}-{max(workload.prompt_tokens)} tokens), outputs "
           f"{args.output_len[0]}-{args.output_len[1]} tokens forced (ignore_eos); greedy; requests per point: "
           + ", ".join(f"{c}: {n}" for c, n in sizes.items()) + ".", "",
           render_table(rows), *skipped_lines(servers.skipped), "",
           "Notes:",
           "- every request's user message is new in the run (the warm-up's too), so only the system prompt "
           "is shared; the warm-up already put it in each prefix cache.",
           *(LLAMA_NOTE if any(s in LLAMA_SYSTEMS for s in systems) else []),
           *(f"- {n}" for n in notes), *retried_lines(rows), *runner.notes(),
           "", "Targets (reports, not assertions):", ttft_ratio(rows, ttft_at)]
    out += server_log_problems(server_logs)
    return "\n".join(out), rows
