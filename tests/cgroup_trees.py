"""Fake file systems for lmi_serve/cgroup.py's readers (the CPU and the memory budgets): /proc/self/cgroup,
/proc/meminfo and the cgroup mounts, written under a test's tmp_path and passed as the `root`."""

from __future__ import annotations

from pathlib import Path

V2 = "sys/fs/cgroup"  # the unified mount; a cgroup2 file system is told by its cgroup.controllers
V1_CPU = "sys/fs/cgroup/cpu,cpuacct"  # v1's CPU controller, mounted with cpuacct as runtimes do
V1_MEMORY = "sys/fs/cgroup/memory"


def tree(root: Path, files: dict[str, str], *, own: str = "0::/\n", mem_total_kib: int = 8 * 2**20) -> Path:
    """`root` holding each of `files` (path under root: text), `own` as /proc/self/cgroup, a meminfo."""
    for path, text in {"proc/self/cgroup": own, "proc/meminfo": f"MemTotal:       {mem_total_kib} kB\n",
                       **files}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def v2(root: Path, files: dict[str, str], own: str = "/") -> Path:
    """A cgroup v2 host: `files` relative to the unified mount, the process in cgroup `own`."""
    return tree(root, {f"{V2}/cgroup.controllers": "cpu memory\n", **{f"{V2}/{k}": v for k, v in files.items()}},
                own=f"0::{own}\n")


def v1(root: Path, files: dict[str, str], own: str = "/") -> Path:
    """A cgroup v1 host: `files` relative to sys/fs/cgroup (`cpu,cpuacct/...`, `memory/...`), the process
    in cgroup `own` of every controller."""
    for mount in (V1_CPU, V1_MEMORY):
        (root / mount).mkdir(parents=True, exist_ok=True)
    return tree(root, {f"sys/fs/cgroup/{k}": v for k, v in files.items()},
                own=f"5:memory:{own}\n4:cpu,cpuacct:{own}\n0::/\n")
