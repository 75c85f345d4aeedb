"""The sweep's measuring loop (bench.py `run_sweep` builds the workload and the report around it).

`SweepRun.serve(group)` starts a group of servers, waits for them, warms each up, measures each at
every HTTP concurrency, and stops them. All systems in one group (the default) keeps every server up
for the whole run; `--one-at-a-time` gives each server a group of its own, so no idle server's
threads wake on the cores the measured one uses. The in-process systems (cb, static) run either with
the last group's servers idle (their CPU is reported) or, one at a time, with none up.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from pathlib import Path

from .clients import DynamicClient, openai_sender, stream_one
from .common import EXTERNAL_SYSTEMS, LLAMA_SYSTEMS, VLLM_SYSTEMS, ModelSource, log
from .inprocess import inproc_point
from .monitor import hwm_mib
from .points import Runner, http_point
from .servers import ServerSettings, Servers, phase_split, warm_up

INPROC_SYSTEMS = ("cb", "static")  # run in a subprocess of the benchmark, not behind HTTP


def sweep_sender(name: str, dyn: DynamicClient) -> tuple[str, object]:
    """(route, sender) of a system in the sweep."""
    if name in LLAMA_SYSTEMS:  # no prompt cache: every request prefills its whole prompt, as ours do
        return "/v1/completions", openai_sender("completions", extra={"cache_prompt": False})
    if name in VLLM_SYSTEMS:
        return "/v1/completions", openai_sender("completions")
    if name == "dynamic":
        return "/invocations", dyn
    return "/invocations", stream_one


@dataclass
class SweepRun:
    """What the sweep measured so far, and how to measure more. `windows`: each concurrency's prompts."""

    rows: list[dict]
    notes: list[str]
    runner: Runner
    workdir: Path
    source: ModelSource
    args: argparse.Namespace
    windows: dict = field(default_factory=dict)
    warm_window: object = None
    dyn: DynamicClient | None = None
    hwm: dict[str, dict[int, float]] = field(default_factory=dict)  # system -> pid -> peak RSS MiB
    skipped: dict[str, str] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)  # external systems' command lines
    logs: dict[str, str] = field(default_factory=dict)
    aborted: bool = False

    def measure_all(self, settings: ServerSettings) -> None:
        """Every system of `args.systems`: the servers all up at once, or one at a time
        (`args.one_at_a_time`), then the in-process systems (with the servers idle, or none up)."""
        served = [s for s in self.args.systems if s not in INPROC_SYSTEMS]
        groups = [[s] for s in served] if self.args.one_at_a_time else [served]
        for i, group in enumerate(groups):
            self.serve(group, settings, inproc_after=i == len(groups) - 1 and not self.args.one_at_a_time)
        if self.args.one_at_a_time or not groups:
            self.inproc_points([])

    def serve(self, group: list[str], settings: ServerSettings, inproc_after: bool) -> None:
        """Start `group`'s servers, measure each at every HTTP concurrency (and, with `inproc_after`,
        the in-process systems while they idle), keep their figures and logs, stop them. After an
        error that is not an interrupt, what was measured stays and the later groups are not run."""
        if self.aborted:
            return
        servers = Servers(self.workdir, group, settings, self.source)
        try:
            servers.wait()
            senders = {name: sweep_sender(name, self.dyn) for name in servers.servers}
            for name, server in list(servers.servers.items()):
                try:
                    self.notes.extend(warm_up(name, server, self.warm_window, self.dyn, senders[name][1],
                                              senders[name][0]))
                except RuntimeError as exc:
                    servers.drop(name, f"warm-up failed: {str(exc)[:300]}")
            try:
                for c in sorted(self.args.concurrency):
                    for name, server in servers.servers.items():
                        path, send = senders[name]
                        run = functools.partial(http_point, name, server, send, path, self.windows[c], c,
                                                len(self.windows[c].prompts))
                        self.rows.append(self.runner.measure(f"{name}@{c}", run))
                if inproc_after:
                    self.inproc_points(servers.pids())
            except Exception as exc:  # noqa: BLE001 - keep what was measured and say why it stopped
                self.notes.append(f"SWEEP ABORTED: {type(exc).__name__}: {str(exc)[-2000:]}")
                log(f"sweep aborted: {type(exc).__name__}: {str(exc)[-2000:]}")
                self.aborted = True
            finally:
                self._keep(servers)
        finally:
            servers.stop()
            self.skipped.update(servers.skipped)

    def inproc_points(self, server_pids: list[int]) -> None:
        """cb and static at each in-process concurrency; a failure is noted and the others go on."""
        args = self.args
        for c in sorted(args.inproc_concurrency):
            for kind in INPROC_SYSTEMS:
                if kind not in args.systems or self.aborted:
                    continue
                extra_notes: list[str] = []
                run = functools.partial(inproc_point, kind, self.windows[c], c, len(self.windows[c].prompts),
                                        args.threads, self.workdir, server_pids, extra_notes, self.source)
                try:
                    self.rows.append(self.runner.measure(f"{kind}@{c}", run))
                except Exception as exc:  # noqa: BLE001 - report and go on with the other systems
                    self.notes.append(f"{kind}@{c} failed: {str(exc)[-1500:]}")
                    log(f"{kind}@{c} FAILED: {str(exc)[-800:]}")
                    continue
                self.notes.extend(x for x in dict.fromkeys(extra_notes) if x not in self.notes)

    def _keep(self, servers: Servers) -> None:
        """Before a group's servers stop: their peak RSS, engine phases, logs and command lines."""
        for name, server in servers.servers.items():
            self.hwm[name] = hwm_mib(server.proc.pid)
            split = phase_split(server) if name not in EXTERNAL_SYSTEMS else None
            if split:
                self.notes.append(f"engine phases of {name} over the whole run: {split}")
            self.logs[name] = server.output()
            if name in EXTERNAL_SYSTEMS:
                self.commands[name] = server.command
