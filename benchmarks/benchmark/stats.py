"""Statistics: percentiles and the per-point summary row."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(name: str, concurrency: int, records: list[dict], wall: float, extra: dict | None = None) -> dict:
    """records: {ok, error, tokens, target, start, ttft, e2e, itl: [...]} (times in seconds)."""
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    e2e = [r["e2e"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok
            if r.get("ttft") is not None and r.get("streamed") and r["tokens"] > 1]
    itl = [gap for r in ok for gap in r.get("itl", [])]
    row = {
        "system": name, "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
        "short": sum(1 for r in ok if r["tokens"] < r["target"]), "out_tokens": tokens, "wall_s": wall,
        "tok_s": tokens / wall if wall > 0 else 0.0, "req_s": len(ok) / wall if wall > 0 else 0.0,
        "error_samples": sorted({str(r["error"])[:300] for r in records if not r["ok"]})[:3],
        "retried": sum(1 for r in records if r.get("retried")),  # reconnected once (clients.post_fresh_on_drop)
    }
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        row[f"{key}_p50"], row[f"{key}_p99"] = percentile(values, 50), percentile(values, 99)
    row["itl_max"] = max(itl, default=None)
    row["ttft_max"] = max(ttft, default=None)
    row.update(extra or {})
    return row
