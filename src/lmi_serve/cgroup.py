"""This process's cgroup folders: where the container's limits are written, for the CPU budget
(cpu_budget.py: `cpu.max`, `cpu.cfs_quota_us`) and the memory budget (serving/memory_budget.py:
`memory.max`, `memory.limit_in_bytes`). Stdlib only: the launcher asks before torch is imported.

Where they are. /proc/self/cgroup names the process's cgroup in each hierarchy: `0::/path` for v2
(unified), `4:cpu,cpuacct:/path` for a v1 controller. The v2 hierarchy is mounted at /sys/fs/cgroup
(/sys/fs/cgroup/unified on a hybrid host), a v1 controller at /sys/fs/cgroup/<its mount>, `cpu,cpuacct`
for the CPU. A limit anywhere between the process's cgroup and the mount applies (a Kubernetes pod's sits
on the pod's cgroup, above the container's), so every level is returned and the caller takes the
smallest. Where the named path is not under the mount, the mount is the process's own cgroup: a
container without a cgroup namespace (Docker on v1) is named by its host path (`/docker/<id>`) but sees
only its own subtree, mounted at the top.

Every path is taken under `root` so that tests read a fake tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

ROOT = Path("/")
_MOUNTS = PurePosixPath("sys/fs/cgroup")


@dataclass(frozen=True)
class Folder:
    """One cgroup folder whose limit files apply to this process."""

    version: int  # 1 or 2: which file names hold the limits
    path: Path


def folders(controller: str, root: Path = ROOT) -> list[Folder]:
    """The folders where `controller`'s limits on this process are: v2's, then v1's, each from the
    process's own cgroup up to the top of its hierarchy. Empty where neither is mounted."""
    own = _own_paths(root)
    found: list[Folder] = []
    v2 = _v2_mount(root)
    if v2 is not None:
        found += [Folder(2, path) for path in _up_to_mount(v2, own.get("", "/"))]
    v1 = _v1_mount(root, controller)
    if v1 is not None:
        found += [Folder(1, path) for path in _up_to_mount(v1, own.get(controller, "/"))]
    return found


def read(path: Path) -> str | None:
    """A limit file's text, stripped; None where it is missing or unreadable (no such controller)."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_paths(root: Path) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}; the v2 line under ''. Empty when it cannot be read."""
    text = read(root / "proc/self/cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(","):  # v2's line has none: ''
            paths[controller] = path
    return paths


def _v2_mount(root: Path) -> Path | None:
    for mount in (root / _MOUNTS, root / _MOUNTS / "unified"):
        if (mount / "cgroup.controllers").is_file():  # only a cgroup2 file system has it
            return mount
    return None


def _v1_mount(root: Path, controller: str) -> Path | None:
    top = root / _MOUNTS
    try:
        names = sorted(entry.name for entry in top.iterdir() if entry.is_dir())
    except OSError:
        return None
    for name in names:  # `cpu`, or `cpu,cpuacct` where the runtime mounted them together
        if controller in name.split(","):
            return top / name
    return None


def _up_to_mount(mount: Path, path: str) -> list[Path]:
    """The folders from `path` (as /proc/self/cgroup names it) up to `mount`, innermost first."""
    parts = PurePosixPath(path).parts[1:]  # without the leading '/'
    inner = mount.joinpath(*parts)
    if ".." in parts or not inner.is_dir():  # outside our view: the mount is our own cgroup
        return [mount]
    chain = [inner]
    while chain[-1] != mount:
        chain.append(chain[-1].parent)
    return chain
