"""Report: the markdown table, the skipped systems, the target checks and ratio lines."""

from __future__ import annotations

OURS = ("rolling", "rolling-dynamic", "rolling-linear-torch", "rolling-fp16", "rolling-q4", "rolling-bf16",
        "rolling-q4-bf16", "rolling-no-prefix", "rolling-ngram", "rolling-sdpa",
        "rolling-separate", "rolling-no-row", "rolling-q4km-bf16", "dynamic")
LIGHTER = ("rolling-fp16", "rolling-q4", "rolling-bf16", "rolling-q4-bf16", "rolling-q4km-bf16")  # opt-in lighter weights
LLAMAS = (("llama-server", "Q4_1"), ("llama-server-f32", "F32"), ("llama-server-q4km", "Q4_K_M"))


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def render_table(rows: list[dict]) -> str:
    head = ("| system | conc | reqs | err | out tok | tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms "
            "| ITL p50 ms | ITL p99 ms | E2E p50 s | E2E p99 s | peak RSS MiB | bg CPU % |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        label = r["system"] + (" (= sequential)" if r["system"] == "rolling" and r["concurrency"] == 1 else "")
        tok_s = f"{r['tok_s']:.1f}"
        if r.get("raw_tok_s") is not None:
            tok_s += f" (raw {r['raw_tok_s']:.1f})"
        err = str(r["errors"]) + (f" ({r['short']} short)" if r.get("short") else "")
        lines.append(
            f"| {label} | {r['concurrency']} | {r['requests']} | {err} | {r['out_tokens']} | {tok_s} "
            f"| {fmt(r['ttft_p50'])} | {fmt(r['ttft_p99'])} "
            f"| {fmt(r['tpot_p50'], 1000, 1)} | {fmt(r['tpot_p99'], 1000, 1)} "
            f"| {fmt(r['itl_p50'], 1000, 1)} | {fmt(r['itl_p99'], 1000, 1)} "
            f"| {fmt(r['e2e_p50'])} | {fmt(r['e2e_p99'])} "
            f"| {r['peak_rss_mib']:.0f} | {r['bg_cpu']:.0f} |")
    return "\n".join(lines)


def find(rows: list[dict], system: str, concurrency: int) -> dict | None:
    return next((r for r in rows if r["system"] == system and r["concurrency"] == concurrency), None)


def target_checks(rows: list[dict], top: int, ttft_conc: int) -> list[str]:
    out = []

    def ratio(label: str, num: dict | None, den: dict | None, goal: float, den_key: str = "tok_s") -> None:
        if num is None or den is None or not den.get(den_key):
            out.append(f"- {label}: not measured")
            return
        value = num["tok_s"] / den[den_key]
        mark = "PASS" if value >= goal else "MISS"
        out.append(f"- {label}: {num['tok_s']:.1f} / {den[den_key]:.1f} = **{value:.2f}x** (target >= {goal}x) {mark}")

    roll = find(rows, "rolling", top)
    ratio(f"rolling@{top} vs sequential (rolling@1) tok/s", roll, find(rows, "rolling", 1), 5.0)
    ratio(f"rolling@{top} vs rolling-dynamic@{top} (the path before the fast engine) tok/s", roll,
          find(rows, "rolling-dynamic", top), 2.0)
    split = find(rows, "rolling-linear-torch", top)
    for label, num, den in (("kv_cache=slots vs dynamic, both on torch's nn.Linear", split,
                             find(rows, "rolling-dynamic", top)),
                            ("linear_kernel=onednn vs torch, both on slots", roll, split)):
        if num and den and den["tok_s"]:
            out.append(f"- (info) {label}, @{top}: {num['tok_s']:.1f} / {den['tok_s']:.1f} = "
                       f"{num['tok_s'] / den['tok_s']:.2f}x")
    ratio(f"rolling@{top} vs transformers CB@{top} tok/s", roll, find(rows, "cb", top), 3.0)
    ratio(f"rolling@{top} vs static ceiling@{top} (useful tok/s)", roll, find(rows, "static", top), 0.75)
    static = find(rows, "static", top)
    if roll and static and static.get("raw_tok_s"):
        out.append(f"- (info) rolling@{top} vs static raw ceiling@{top} (all rows padded to the longest): "
                   f"{roll['tok_s']:.1f} / {static['raw_tok_s']:.1f} = {roll['tok_s'] / static['raw_tok_s']:.2f}x")
    dyn = find(rows, "dynamic", top)
    if roll and dyn and dyn["tok_s"]:
        out.append(f"- (info) rolling@{top} vs dynamic@{top} tok/s: {roll['tok_s'] / dyn['tok_s']:.2f}x")
    for light in LIGHTER:
        ratio(f"{light}@{top} vs rolling-dynamic@{top} tok/s", find(rows, light, top),
              find(rows, "rolling-dynamic", top), 3.0)
    out += tpot_ratios(rows)
    out += llama_ratios(rows, sorted({1, top}))
    out += vllm_ratios(rows, sorted({1, top}))
    if any(r["system"] == "vllm-cpu-bf16" for r in rows):
        out += vllm_ratios(rows, sorted({1, top}), reference="vllm-cpu-bf16")
        for c in sorted({1, top}):  # issue 67: bf16 against bf16
            ratio(f"rolling-bf16@{c} vs vllm-cpu-bf16@{c} tok/s", find(rows, "rolling-bf16", c),
                  find(rows, "vllm-cpu-bf16", c), 1.1)
    if any(r["system"] == "rolling-q4km-bf16" for r in rows):  # issue 61: a Q4_K_M file as fast as Q4_1
        for c in sorted({1, top}):
            ratio(f"rolling-q4km-bf16@{c} vs rolling-q4-bf16@{c} (the Q4_1 path) tok/s",
                  find(rows, "rolling-q4km-bf16", c), find(rows, "rolling-q4-bf16", c), 0.95)
        ratio("rolling-q4km-bf16@1 vs llama-server-q4km@1 (the same file) tok/s", find(rows, "rolling-q4km-bf16", 1),
              find(rows, "llama-server-q4km", 1), 1.0)
    t16 = find(rows, "rolling", ttft_conc)
    if t16 is None or t16["ttft_p50"] is None:
        out.append(f"- rolling TTFT p50 at {ttft_conc} clients: not measured")
    else:
        mark = "PASS" if t16["ttft_p50"] < 1.0 else "MISS"
        out.append(f"- rolling TTFT p50 at {ttft_conc} clients: **{t16['ttft_p50']:.2f} s** (target < 1 s) {mark}")
    return out


def tpot_ratios(rows: list[dict]) -> list[str]:
    """Single-stream TPOT p50 of each streaming system / rolling's and / rolling-dynamic's (the path
    before the fast engine, which the opt-in weights' target of <= 0.5x is set against)."""
    out = []
    for base_name in ("rolling", "rolling-dynamic"):
        base = find(rows, base_name, 1)
        if base is None or not base.get("tpot_p50"):
            out.append(f"- single-stream TPOT ratios: {base_name}@1 not measured")
            continue
        for r in rows:
            if r["concurrency"] != 1 or r["system"] == base_name or not r.get("tpot_p50"):
                continue
            value = r["tpot_p50"] / base["tpot_p50"]
            goal = " (target <= 0.5x) " + ("PASS" if value <= 0.5 else "MISS") if r["system"] in LIGHTER \
                and base_name == "rolling-dynamic" else ""
            out.append(f"- single-stream TPOT p50 {r['system']} / {base_name}: {r['tpot_p50'] * 1000:.1f} / "
                       f"{base['tpot_p50'] * 1000:.1f} ms = **{value:.2f}x**{goal}")
    return out


def llama_ratios(rows: list[dict], points: list[int]) -> list[str]:
    """tok/s of each of our systems / llama-server's (Q4_1 and F32) at the given concurrencies
    (above 1x: ours is faster)."""
    out = []
    for llama, label in LLAMAS:
        for c in points:
            ref = find(rows, llama, c)
            if ref is None or not ref["tok_s"]:
                continue
            parts = [f"{name} {r['tok_s'] / ref['tok_s']:.2f}x" for name in OURS
                     if (r := find(rows, name, c)) is not None]
            if parts:
                out.append(f"- tok/s vs {llama} ({label}, {ref['tok_s']:.1f} tok/s) at {c} client(s): "
                           + ", ".join(parts))
    return out


def vllm_ratios(rows: list[dict], points: list[int], reference: str = "vllm-cpu") -> list[str]:
    """tok/s of every other system measured at each point / vLLM CPU's there (above 1x: faster than vLLM)."""
    out = []
    for c in points:
        ref = find(rows, reference, c)
        if ref is None or not ref["tok_s"]:
            out.append(f"- tok/s vs {reference} at {c} client(s): not measured")
            continue
        parts = [f"{r['system']} {r['tok_s'] / ref['tok_s']:.2f}x" for r in rows
                 if r["concurrency"] == c and r["system"] != reference]
        out.append(f"- tok/s vs {reference} ({ref['tok_s']:.1f} tok/s) at {c} client(s): "
                   + (", ".join(parts) or "no other system"))
    return out


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    return ["", *(f"- {name}: skipped: {reason}" for name, reason in skipped.items())] if skipped else []


def server_log_problems(server_logs: dict[str, str]) -> list[str]:
    problems = []
    for name, text in server_logs.items():
        bad = [ln for ln in text.splitlines() if any(w in ln for w in ("ERROR", "Traceback", "CRITICAL", "WARNING"))]
        if bad:
            problems.append(f"- {name} server log: {len(bad)} warning/error line(s), e.g. " + " | ".join(bad[:3])[:600])
    return ["", "Server log problems:", *problems] if problems else []


def retried_lines(rows: list[dict]) -> list[str]:
    retried = [f"{r['system']}@{r['concurrency']}: {r['retried']}" for r in rows if r.get("retried")]
    return ["- requests sent again on a new connection after the server closed a kept-alive one unanswered: "
            + ", ".join(retried)] if retried else []
