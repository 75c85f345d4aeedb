"""Running one measured point: wait for the machine to calm down, run, re-run a disturbed point.
Shared by the sweep and the chat workload (benchmarks/bench.py)."""

from __future__ import annotations

from .clients import closed_loop
from .common import log
from .monitor import Monitor, wait_for_quiet
from .report import fmt
from .stats import summarize


class Runner:
    """Remembers the waits and re-runs of a run for its notes.
    quiet_wait/quiet_threshold/noisy/retries: as benchmarks/bench.py's options of those names."""

    def __init__(self, quiet_wait: float, quiet_threshold: float, noisy: float, retries: int):
        self.quiet_wait, self.quiet_threshold, self.noisy, self.retries = quiet_wait, quiet_threshold, noisy, retries
        self.waits: list[tuple[str, float, float]] = []
        self.reruns: list[str] = []

    def quiet(self, label: str) -> None:
        if self.quiet_wait <= 0:
            return
        waited, bg = wait_for_quiet(self.quiet_wait, self.quiet_threshold)
        self.waits.append((label, waited, bg))
        if waited > 3.5:
            log(f"waited {waited:.0f} s for other load to calm down before {label} (outside CPU now {bg:.0f}%)")

    def measure(self, label: str, run) -> dict:
        """quiet -> run; a run disturbed by outside load (bg CPU > noisy) is repeated up to `retries`
        times and the least disturbed run is kept."""
        best = None
        for attempt in range(1 + self.retries):
            self.quiet(label)
            row = run()
            row["attempts"] = attempt + 1
            log(f"{label:12s} {row['tok_s']:6.1f} tok/s, TTFT p50 {fmt(row['ttft_p50'])} s, max ITL "
                f"{fmt(row['itl_max'])} s, errors {row['errors']}, wall {row['wall_s']:.1f} s, "
                f"bg CPU {row['bg_cpu']:.0f}%" + (f" (attempt {attempt + 1})" if attempt else ""))
            for sample in row["error_samples"]:
                log(f"  error sample: {sample}")
            if best is None or row["bg_cpu"] < best["bg_cpu"]:
                best = row
            if best["bg_cpu"] <= self.noisy:
                break
        if best["attempts"] > 1 or best["bg_cpu"] > self.noisy:
            self.reruns.append(f"{label} kept attempt {best['attempts']} (bg CPU {best['bg_cpu']:.0f}%)")
        return best

    def notes(self) -> list[str]:
        out = []
        long_waits = [f"{label} {w:.0f} s (outside CPU then {bg:.0f}%)" for label, w, bg in self.waits if w > 3.5]
        if long_waits:
            out.append("- waited for other load before: " + "; ".join(long_waits))
        if self.reruns:
            repeated = " (a re-run repeats the point's prompts, so a prefix cache hits)" if self.retries else ""
            out.append(f"- points disturbed by outside load above {self.noisy:.0f}% of a core: "
                       + "; ".join(self.reruns) + repeated)
        return out


def http_point(name: str, server, send, path: str, workload, concurrency: int, n: int) -> dict:
    """One closed-loop point against one server; a server that died during it fails the point."""
    with Monitor(server.proc.pid) as mon:
        records, wall = closed_loop(send, server.url(path), workload, concurrency, n)
    if server.proc.poll() is not None:
        raise RuntimeError(f"{name} server died (rc {server.proc.returncode}):\n{server.output()[-3000:]}")
    return summarize(name, concurrency, records, wall, {"peak_rss_mib": mon.peak_rss / 2**20,
                                                        "bg_cpu": mon.bg_cpu_percent})
