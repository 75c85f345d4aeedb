"""A failed install fails the step that ran it: scripts/_setup.sh with a pip that fails, in every way it
is called (the Dockerfile's dependency RUN under /bin/sh, as podman and buildah run it in their default OCI
format; sourced inside an `&&` chain, where bash ignores `set -e`; sourced as the scripts do) exits
non-zero, writes no install stamp, and says which step failed. Without this, the image build cached a
layer with the stamp written and no lmi_serve, and died two steps later."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_dockerfile import DOCKERFILE, ROOT, instructions

SETUP = ROOT / "scripts" / "_setup.sh"
# The serve install's pip steps: torch, the project, the model packages
SERVE_STEPS = 3
# A venv's python whose pip fails at install number FAKE_PIP_FAIL_AT, as for a wheel the index cannot
# serve; each call is logged, so a test sees which steps ran.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_PIP_LOG"
if [ "$(wc -l < "$FAKE_PIP_LOG")" -eq "${FAKE_PIP_FAIL_AT:-0}" ]; then
    echo "ERROR: No matching distribution found for $*" >&2
    exit 1
fi
"""


def dependency_run() -> str:
    """The Dockerfile's RUN that installs the dependencies (the one that calls _setup.sh)."""
    (run,) = [arguments for keyword, arguments in instructions(DOCKERFILE.read_text())
              if keyword == "RUN" and "_setup.sh" in arguments]
    return run


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The build's WORKDIR as the dependency step sees it: pyproject.toml and scripts/_setup.sh copied in."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(SETUP, tmp_path / "scripts")
    return tmp_path


def fake_venv(workdir: Path, fail_at: int) -> dict[str, str]:
    """A venv whose python is FAKE_PYTHON, and the environment that points _setup.sh at it."""
    python = workdir / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return {"PATH": os.environ["PATH"], "HOME": str(workdir), "LMI_SERVE_VENV": str(workdir / "venv"),
            "FAKE_PIP_LOG": str(workdir / "pip.log"), "FAKE_PIP_FAIL_AT": str(fail_at), "TORCH_INDEX_URL": ""}


def run(command: list[str], workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)


def pip_calls(workdir: Path) -> list[str]:
    log = workdir / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("fail_at", range(1, SERVE_STEPS + 1))
def test_a_failed_pip_stops_the_dockerfiles_dependency_step(workdir, fail_at):
    done = run(["/bin/sh", "-c", dependency_run()], workdir, fake_venv(workdir, fail_at))
    assert done.returncode != 0, done.stderr
    assert not (workdir / "venv" / ".lmi-serve-installed").exists()
    assert len(pip_calls(workdir)) == fail_at  # stopped at the failure, not after the next steps
    assert "No matching distribution" in done.stderr and "[setup] failed" in done.stderr


def test_the_dependency_step_succeeds_and_stamps_when_every_install_does(workdir):
    # The other side of the tests above: the RUN line itself runs under /bin/sh.
    done = run(["/bin/sh", "-c", dependency_run()], workdir, fake_venv(workdir, 0))
    assert done.returncode == 0, done.stderr
    assert (workdir / "venv" / ".lmi-serve-installed").read_text().strip().endswith("-serve")
    assert len(pip_calls(workdir)) == SERVE_STEPS
    assert (workdir / "src" / "lmi_serve" / "__init__.py").exists()  # the stand-in package, before the code


def test_a_wheel_the_index_cannot_serve_fails_the_dependency_step(workdir):
    # As a user meets it: the real pip, with an index that has nothing (dry run: nothing is installed).
    python = workdir / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@" --dry-run --ignore-installed\n')
    python.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir), "LMI_SERVE_VENV": str(workdir / "venv"),
           "TORCH_INDEX_URL": "", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    done = run(["/bin/sh", "-c", dependency_run()], workdir, env)
    assert done.returncode != 0
    assert "No matching distribution found for torch" in done.stderr, done.stderr
    assert not (workdir / "venv" / ".lmi-serve-installed").exists()


@pytest.mark.parametrize("caller", [
    'source scripts/_setup.sh serve && echo reached',  # bash ignores set -e inside the sourced script here
    'if ! source scripts/_setup.sh serve; then exit 3; fi; echo reached',  # as is an `if`'s condition
    'source scripts/_setup.sh serve || exit 1; echo reached',  # how scripts/serve, test, bench, soak call it
    'bash scripts/_setup.sh serve && echo reached',
])
def test_every_way_of_calling_setup_stops_at_a_failed_install(workdir, caller):
    done = run(["bash", "-c", caller], workdir, fake_venv(workdir, 2))
    assert done.returncode != 0 and "reached" not in done.stdout, done.stdout + done.stderr
    assert not (workdir / "venv" / ".lmi-serve-installed").exists()
    assert len(pip_calls(workdir)) == 2


def test_a_venv_that_cannot_be_made_stops_setup(workdir):
    env = {**fake_venv(workdir, 0), "LMI_SERVE_VENV": str(workdir / "absent"), "PYTHON": "false"}
    done = run(["bash", "-c", "source scripts/_setup.sh serve && echo reached"], workdir, env)
    assert done.returncode != 0 and "reached" not in done.stdout
    assert "[setup] failed" in done.stderr and "venv" in done.stderr


def test_sourcing_setup_leaves_the_venv_first_on_path(workdir):
    done = run(["bash", "-c", 'source scripts/_setup.sh serve || exit 1; echo "$VENV"; command -v python'],
               workdir, fake_venv(workdir, 0))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(workdir / "venv"), str(workdir / "venv" / "bin" / "python")]
