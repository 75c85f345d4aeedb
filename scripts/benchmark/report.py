"""Report: the markdown table and the target checks."""

from __future__ import annotations


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
    ratio(f"rolling@{top} vs rolling-dynamic@{top} (kv_cache=slots vs dynamic) tok/s", roll,
          find(rows, "rolling-dynamic", top), 2.0)
    ratio(f"rolling@{top} vs transformers CB@{top} tok/s", roll, find(rows, "cb", top), 3.0)
    ratio(f"rolling@{top} vs static ceiling@{top} (useful tok/s)", roll, find(rows, "static", top), 0.75)
    static = find(rows, "static", top)
    if roll and static and static.get("raw_tok_s"):
        out.append(f"- (info) rolling@{top} vs static raw ceiling@{top} (all rows padded to the longest): "
                   f"{roll['tok_s']:.1f} / {static['raw_tok_s']:.1f} = {roll['tok_s'] / static['raw_tok_s']:.2f}x")
    dyn = find(rows, "dynamic", top)
    if roll and dyn and dyn["tok_s"]:
        out.append(f"- (info) rolling@{top} vs dynamic@{top} tok/s: {roll['tok_s'] / dyn['tok_s']:.2f}x")
    t16 = find(rows, "rolling", ttft_conc)
    if t16 is None or t16["ttft_p50"] is None:
        out.append(f"- rolling TTFT p50 at {ttft_conc} clients: not measured")
    else:
        mark = "PASS" if t16["ttft_p50"] < 1.0 else "MISS"
        out.append(f"- rolling TTFT p50 at {ttft_conc} clients: **{t16['ttft_p50']:.2f} s** (target < 1 s) {mark}")
    return out
