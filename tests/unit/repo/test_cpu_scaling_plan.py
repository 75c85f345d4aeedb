"""benchmarks/bench_cpu_scaling.py without a server: which layouts it runs on a box and in which order, the table's
"x linear" and the issue's two targets, and the window's counting of streamed tokens."""

from __future__ import annotations

import pytest

from benchmarks.bench_cpu_scaling import parse_args
from benchmarks.benchmark.scaling import default_layouts, parse_layout, render, run_order
from benchmarks.benchmark.window import Request, summarize


def names(layouts) -> list[str]:
    return [layout.name for layout in layouts]


def test_the_default_layouts_are_the_issues_on_16_cpus_and_scale_down_to_2():
    assert names(default_layouts(16)) == ["1", "2", "4", "8", "16", "2x8", "4x4", "auto"]
    assert names(default_layouts(2)) == ["1", "2", "2x1", "auto"]
    assert names(default_layouts(12)) == ["1", "2", "4", "8", "12", "2x6", "4x3", "auto"]
    layouts = {layout.name: layout for layout in default_layouts(16)}
    assert (layouts["4x4"].cpus, layouts["4x4"].replicas) == (16, 4)
    assert (layouts["8"].cpus, layouts["8"].replicas) == (8, None)
    assert (layouts["auto"].cpus, layouts["auto"].replicas) == (16, "auto")


def test_the_baseline_and_the_full_box_run_first_and_one_core_last():
    assert names(run_order(default_layouts(16))) == ["2", "16", "2x8", "4x4", "auto", "8", "4", "1"]


@pytest.mark.parametrize("item, message", [("2x8", "needs 16 CPUs; this process may use 2"),
                                           ("3y", "expected N"), ("0", "needs 0 CPUs")])
def test_a_layout_that_cannot_run_here_is_refused_by_name(item, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(item, 2)


def test_the_command_line_refuses_a_layout_larger_than_the_box(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--layouts", "1,100000"])
    assert "layout '100000' needs 100000 CPUs" in capsys.readouterr().err
    assert names(parse_args(["--layouts", "1, auto"]).layouts) == ["1", "auto"]


def row(layout: str, cpus: int, replicas, tok_s: float, engines: int) -> dict:
    return {"layout": layout, "cpus": cpus, "replicas": replicas, "tok_s": tok_s, "engines": engines,
            "client_cpus": "own", "client_cpu": 0.1, "tpot_p50_ms": 50.0, "ttft_p50_ms": 200.0, "start_s": 9.0,
            "server": {"cpuThreads": {"threadsPerWorker": cpus // engines}}}


def test_the_table_is_per_core_against_the_two_core_row_and_judges_both_targets():
    rows = [row("1", 1, None, 60.0, 1), row("2", 2, None, 100.0, 1), row("16", 16, None, 500.0, 1),
            row("2x8", 16, 2, 640.0, 2), row("auto", 16, "auto", 600.0, 2)]
    text = "\n".join(render(rows, clients=64, window=15))
    assert [r["x_linear"] for r in rows] == [1.2, 1.0, 0.62, 0.8, 0.75]
    assert "| 2x8 | 16 | 2 x 8 | 640 | 0.8 | 50 | 200 | 9 |" in text
    assert "| auto | 16 | auto: 2 x 8 | 600 | 0.75 |" in text
    assert "best layout on 16 cores: 2x8 (2 x 8), 640.0 tok/s, 0.8x linear from the 2-core row: meets" in text
    assert "auto (auto: 2 x 8): 600.0 tok/s, 0.94 of the best: within 10 %" in text
    rows[3]["tok_s"] = 800.0  # auto at 0.75 of the best, the best at 1.0x
    assert "0.75 of the best: NOT within 10 %" in "\n".join(render(rows, clients=64, window=15))


def test_a_failed_layout_keeps_its_row_and_a_server_on_other_threads_is_flagged():
    rows = [row("2", 2, None, 100.0, 1), {"layout": "4x4", "cpus": 16, "replicas": 4, "error": "TimeoutError: boom"},
            row("16", 16, None, 400.0, 1)]
    rows[2]["server"]["cpuThreads"]["threadsPerWorker"] = 64
    text = "\n".join(render(rows, clients=64, window=15))
    assert "| 4x4 | 16 | 4 x 4 |  |  |  |  |  | TimeoutError: boom |" in text
    assert "SERVER RAN 64 threads an engine" in text
    assert "MISSES the 0.7x target" in text  # 400 tok/s on 16 cores = 0.5x of 50 per core


def test_the_window_counts_the_tokens_that_arrived_inside_it_whatever_request_carried_them():
    spanning = Request(start=0.0, times=[1.0, 2.0, 3.0, 11.0, 12.0], end=12.5, done=True)
    ended = Request(start=4.0, times=[5.0, 5.5, 6.0], end=6.1, done=True)
    late = Request(start=9.0, times=[9.5, 13.0], end=None)
    failed = Request(start=7.0, error="HTTP 503: busy", end=7.1)
    result = summarize([spanning, ended, late, failed], opened=2.0, closed=12.0, ramp_s=2.0, capped=False,
                       client_cpu=0.1)
    assert result.tokens == 2 + 3 + 1 + 2  # 2.0, 3.0 | 5.0-6.0 | 9.5 | 11.0, 12.0
    assert result.tok_s == pytest.approx(0.8)
    assert result.finished == 1 and result.tpot_p50_ms == 500.0  # only `ended` ended inside the window
    assert result.ttft_p50_ms == 750.0  # started inside: ended (1.0 s), late (0.5 s)
    assert result.errors == ["HTTP 503: busy"]
