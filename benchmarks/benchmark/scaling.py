"""bench_cpu_scaling's layouts (which servers to start, in which order) and its report (one markdown table and
the issue's two targets), kept apart from the servers and clients so that tests/unit/repo can check them."""

from __future__ import annotations

import re
from dataclasses import dataclass

BASELINE_CORES = 2  # "x linear" is per core against one engine on this many CPUs (the "from 2")
TARGET_LINEAR, TARGET_AUTO = 0.7, 0.9


@dataclass(frozen=True)
class Layout:
    """`cpus`: the server's affinity (the first `cpus` of the mask); `replicas`: option.engine_replicas
    (None: unset, one engine unpinned within the affinity)."""

    name: str
    cpus: int
    replicas: int | str | None = None

    def label(self) -> str:
        if self.replicas is None:
            return f"1 engine x {self.cpus} threads"
        if self.replicas == "auto":
            return "auto"
        return f"{self.replicas} replicas x {self.cpus // int(self.replicas)} threads"


def parse_layout(item: str, available: int) -> Layout:
    """`N`, `RxT` or `auto` (module docstring); ValueError naming the item where it does not fit `available` CPUs."""
    item = item.strip().lower()
    if item == "auto":
        return Layout("auto", available, "auto")
    match = re.fullmatch(r"(\d+)(?:x(\d+))?", item)
    if not match:
        raise ValueError(f"layout {item!r}: expected N (one engine on N CPUs), RxT (R replicas of T) or auto")
    if match.group(2) is None:
        layout = Layout(item, int(match.group(1)))
    else:
        replicas, threads = int(match.group(1)), int(match.group(2))
        layout = Layout(item, replicas * threads, replicas)
    if not 1 <= layout.cpus <= available:
        raise ValueError(f"layout {item!r} needs {layout.cpus} CPUs; this process may use {available}")
    return layout


def default_layouts(available: int) -> list[Layout]:
    """One engine on 1, 2, 4, ... CPUs and on all of them; 2 and 4 replicas splitting all of them evenly; auto."""
    singles = sorted({2 ** k for k in range(available.bit_length()) if 2 ** k <= available} | {available})
    items = [str(n) for n in singles]
    items += [f"{r}x{available // r}" for r in (2, 4) if r <= available and available % r == 0]
    return [parse_layout(item, available) for item in [*items, "auto"]]


def run_order(layouts: list[Layout]) -> list[Layout]:
    """The rows the targets need first (the baseline, every CPU's layouts), the smaller singles last, so a run
    cut short by its deadline still answers the issue's two questions."""
    top = max(layout.cpus for layout in layouts)

    def rank(layout: Layout) -> tuple[int, int]:
        if layout.replicas is None and layout.cpus == BASELINE_CORES:
            return (0, 0)
        if layout.cpus == top:
            return (1, 0 if layout.replicas is None else 1)
        return (2, -layout.cpus)

    return sorted(layouts, key=rank)


def expected_replicas(layout: Layout) -> int:
    if layout.replicas is None:
        return 1
    if layout.replicas == "auto":  # the server's own rule on this budget (checked against its log after the start)
        from lmi_serve.cpu_budget import cpu_budget
        from lmi_serve.server.cpu_replicas import auto_replicas

        return auto_replicas(cpu_budget(None, {}, affinity=layout.cpus).threads)
    return int(layout.replicas)


def x_linear(rows: list[dict]) -> None:
    """Each row's tok/s per core over the baseline's (one engine on BASELINE_CORES CPUs, else the fewest)."""
    singles = [r for r in rows if r.get("tok_s") and r["replicas"] is None]
    base = next((r for r in singles if r["cpus"] == BASELINE_CORES), min(singles, key=lambda r: r["cpus"], default=None))
    for row in rows:
        if base and row.get("tok_s"):
            row["x_linear"] = round(row["tok_s"] / row["cpus"] / (base["tok_s"] / base["cpus"]), 2)
            row["baseline"] = base["layout"]


# -- the report ----------------------------------------------------------------------------------------------


def engines_cell(row: dict) -> str:
    engines = row.get("engines") or (1 if row["replicas"] is None else row["replicas"])
    if not isinstance(engines, int):
        return "auto: ?"
    cell = f"{engines} x {row['cpus'] // engines}"
    return f"auto: {cell}" if row["replicas"] == "auto" else cell


def note_cell(row: dict, expected_threads: int | None) -> str:
    if row.get("error"):
        return row["error"].splitlines()[0][:160]
    notes = [f"clients {row['client_cpus']} ({row['client_cpu']:.2f} cores)"]
    if len(row.get("requests_per_engine") or []) > 1:
        notes.append("requests per engine " + "/".join(map(str, row["requests_per_engine"])))
    per_worker = ((row.get("server") or {}).get("cpuThreads") or {}).get("threadsPerWorker")
    if expected_threads and per_worker not in (None, expected_threads):
        notes.append(f"SERVER RAN {per_worker} threads an engine")
    if row.get("ramp_capped"):
        notes.append("window opened before every client had a token")
    if row.get("errors"):
        notes.append("request errors: " + "; ".join(e[:80] for e in row["errors"]))
    return ", ".join(notes).replace("|", "/")


def render(rows: list[dict], clients: int, window: float) -> list[str]:
    """ONE markdown table, rows in the layouts' order, then the two targets."""
    x_linear(rows)
    base = next((r["baseline"] for r in rows if r.get("baseline")), None)
    head = ["layout", "cores", "engines x threads", "tok/s", f"x linear (from the {base or '?'}-core row)",
            "TPOT p50 ms", "TTFT p50 ms", "start s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        engines = row.get("engines") or 1
        cells = [row["layout"], str(row["cpus"]), engines_cell(row), _num(row.get("tok_s")), _num(row.get("x_linear")),
                 _num(row.get("tpot_p50_ms")), _num(row.get("ttft_p50_ms")), _num(row.get("start_s")),
                 note_cell(row, row["cpus"] // engines if isinstance(engines, int) else None)]
        lines.append("| " + " | ".join(cells) + " |")
    return (lines + [""] + targets(rows) + [kernels_line(rows),
            f"- {clients} closed-loop streaming clients, a {window:g} s window per layout; x linear = tok/s / "
            "(the baseline's tok/s per core x cores); TPOT p50 over the requests that ended in the window, TTFT p50 "
            "over those that started in it"])


def targets(rows: list[dict]) -> list[str]:
    measured = [r for r in rows if r.get("tok_s")]
    if not measured:
        return ["- no layout was measured"]
    top = max(r["cpus"] for r in measured)
    at_top = [r for r in measured if r["cpus"] == top]
    best = max(at_top, key=lambda r: r["tok_s"])
    lines = []
    if best.get("x_linear") is not None and top > BASELINE_CORES:
        verdict = "meets" if best["x_linear"] >= TARGET_LINEAR else "MISSES"
        lines.append(f"- best layout on {top} cores: {best['layout']} ({engines_cell(best)}), {best['tok_s']} tok/s, "
                     f"{best['x_linear']}x linear from the {best['baseline']}-core row: {verdict} the "
                     f"{TARGET_LINEAR}x target")
    auto = next((r for r in at_top if r["replicas"] == "auto"), None)
    if auto:
        share = auto["tok_s"] / best["tok_s"]
        verdict = "within" if share >= TARGET_AUTO else "NOT within"
        lines.append(f"- auto ({engines_cell(auto)}): {auto['tok_s']} tok/s, {share:.2f} of the best: {verdict} 10 %")
    return lines


def _num(value) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def kernels_line(rows: list[dict]) -> str:
    """What computed (GET /models/<m>'s kernel plan, the first measured server's): numba, where the image's is
    missing or too old, leaves oneDNN and SDPA, and the table then measures those."""
    plan = next(((r.get("server") or {}).get("kernels") for r in rows if (r.get("server") or {}).get("kernels")), None)
    if not plan:
        return "- kernels: not reported"
    host = plan.get("host") or {}
    used = sorted(name for name, state in (plan.get("kernels") or {}).items() if state == "used")
    return (f"- kernels: numba {host.get('numba')} (OpenMP layer {'yes' if host.get('omp_layer') else 'no'}), "
            f"oneDNN {'yes' if host.get('onednn') else 'no'}, bf16 {host.get('bf16')}; used: {', '.join(used) or 'none'}")
