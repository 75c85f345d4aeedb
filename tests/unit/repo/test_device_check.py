"""scripts/device_check.py's runner of the GPU tests and the benchmark: its deadline holds for a child that
prints nothing (a hung test), together with the child's own subprocesses, which hold its output pipe open."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "device_check.py"


def load():
    spec = importlib.util.spec_from_file_location("device_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_silent_child_and_its_subprocesses_are_killed_at_the_deadline(tmp_path):
    device_check = load()
    log = tmp_path / "run.log"
    started = time.monotonic()
    code, seconds = device_check.run_logged(["bash", "-c", "echo started; sleep 60 & sleep 60"], log, {}, 1)
    assert code is None and time.monotonic() - started < 20  # not the 60 s of the child or its grandchild
    assert 1 <= seconds < 20
    assert log.read_text().startswith("started") and "killed after 1 s" in log.read_text()


def test_a_child_that_ends_in_time_gives_its_exit_code_and_output(tmp_path, capsys):
    device_check = load()
    log = tmp_path / "run.log"
    code, _ = device_check.run_logged([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], log, {}, 60)
    assert code == 3 and log.read_text() == "hello\n" and "hello" in capsys.readouterr().out
