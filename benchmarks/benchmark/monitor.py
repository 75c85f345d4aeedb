"""Process monitoring: process-tree CPU/RSS and the CPU used outside the benchmark."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Self


def tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(proc) -> float | None:
    """user + system CPU seconds of one process, or None if it is gone."""
    try:
        t = proc.cpu_times()
    except Exception:  # noqa: BLE001 - a process may exit between listing and reading
        return None
    return t.user + t.system


def rss_bytes(proc) -> int:
    try:
        return proc.memory_info().rss
    except Exception:  # noqa: BLE001 - a process may exit between listing and reading
        return 0


def tree_rss(pid: int) -> int:
    return sum(rss_bytes(proc) for proc in tree(pid))


def tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(proc) or 0.0 for proc in tree(pid))


def hwm_mib(pid: int) -> dict[int, float]:
    """VmHWM (the kernel's peak RSS) of every process in a tree."""
    out = {}
    for proc in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[proc.pid] = int(line.split()[1]) / 1024
    return out


def own_cpu() -> dict[int, float]:
    """CPU seconds of this process and every descendant (servers, workers), per pid."""
    seconds = {proc.pid: cpu_seconds(proc) for proc in tree(os.getpid())}
    return {pid: value for pid, value in seconds.items() if value is not None}


def busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


class OutsideLoad:
    """CPU seconds used on this machine by processes that are not this benchmark or its children."""

    def __init__(self) -> None:
        self.total = 0.0
        self._busy, self._ours = busy_seconds(), own_cpu()

    def sample(self) -> float:
        busy, ours = busy_seconds(), own_cpu()
        ours_delta = sum(v - self._ours.get(pid, 0.0) for pid, v in ours.items())
        delta = max(0.0, busy - self._busy - ours_delta)
        self._busy, self._ours = busy, ours
        self.total += delta
        return delta


class Monitor:
    """Samples one process tree's RSS, and the CPU used outside this benchmark, while a point runs."""

    def __init__(self, target_pid: int, interval: float = 0.5):
        self.target, self.interval = target_pid, interval
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self.started = time.monotonic()
        self.outside = OutsideLoad()
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, tree_rss(self.target))
        self.outside.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.elapsed = time.monotonic() - self.started

    @property
    def bg_cpu_percent(self) -> float:
        """Average CPU use outside this benchmark's processes, in % of one core."""
        return 100.0 * self.outside.total / max(self.elapsed, 1e-9)


def wait_for_quiet(max_wait: float, threshold: float) -> tuple[float, float]:
    """Wait (up to max_wait s) until processes outside this benchmark use < threshold % of one core
    for two consecutive 1 s windows. Returns (seconds waited, last window's outside CPU %)."""
    started = time.monotonic()
    quiet_windows, last = 0, 0.0
    load = OutsideLoad()
    while True:
        time.sleep(1.0)
        last = 100.0 * load.sample()
        quiet_windows = quiet_windows + 1 if last < threshold else 0
        waited = time.monotonic() - started
        if quiet_windows >= 2 or waited >= max_wait:
            return waited, last
