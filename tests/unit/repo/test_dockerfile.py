"""The Dockerfile cannot go stale unnoticed: what its RUN lines import from lmi_serve exists, what it
copies is in the build context, and hadolint finds nothing (.hadolint.yaml names the one ignored rule).
Building and running the image is scripts/test-container's job; this is the fast half, in every run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comment lines dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        logical.append((keyword.upper(), arguments.strip()))
        pending = ""
    return logical


def python_snippets(run: str) -> list[str]:
    """The code of every `python... -c CODE` in a RUN line."""
    words = shlex.split(run, posix=True)
    return [words[i + 1] for i, word in enumerate(words[:-1])
            if word == "-c" and i > 0 and re.search(r"python[\d.]*$", words[i - 1])]


def lmi_serve_imports(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for `from lmi_serve... import name` and (module, None) for `import lmi_serve...`."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lmi_serve":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "lmi_serve"]
    return found


def copy_sources(arguments: str) -> list[str]:
    words = [word for word in shlex.split(arguments) if not word.startswith("--")]
    return words[:-1]


RUNS = [arguments for keyword, arguments in instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
IMPORTS = sorted({item for run in RUNS for code in python_snippets(run) for item in lmi_serve_imports(code)},
                 key=str)
MODULES_RUN = sorted({module for run in RUNS for module in re.findall(r"python[\d.]* -m ([\w.]+)", run)})
COPIED = [source for keyword, arguments in instructions(DOCKERFILE.read_text()) if keyword == "COPY"
          for source in copy_sources(arguments)]


def test_the_parser_finds_what_the_dockerfile_uses():
    # Guards the tests below against passing because the parsing found nothing to check.
    assert ("lmi_serve.model.loader", "load_generation_model") in IMPORTS
    assert "lmi_serve" in MODULES_RUN
    assert {"pyproject.toml", "src", "serving.properties"} <= set(COPIED)


@pytest.mark.parametrize(("module", "name"), IMPORTS, ids=[f"{m}:{n}" for m, n in IMPORTS])
def test_every_name_a_run_line_imports_exists(module, name):
    imported = importlib.import_module(module)
    if name is not None:
        assert hasattr(imported, name), f"the Dockerfile imports {name} from {module}, which has no such name"


@pytest.mark.parametrize("module", MODULES_RUN)
def test_every_module_a_run_line_runs_with_dash_m_exists(module):
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"python -m {module}: no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"python -m {module}: no __main__"


@pytest.mark.parametrize("source", COPIED)
def test_every_copy_source_exists_and_is_in_the_build_context(source):
    assert (ROOT / source).exists(), f"COPY {source}: no such file or folder"
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    context = exclude_paths(str(ROOT), ignore)
    assert source in context or any(path.startswith(f"{source}/") for path in context), \
        f"COPY {source}: .dockerignore leaves it out of the build context"


def test_the_build_context_leaves_out_the_venv_git_and_tests():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    context = exclude_paths(str(ROOT), ignore)
    assert not [path for path in context if path.split("/")[0] in {".venv", ".git", "tests"}]
    assert not [path for path in context if "__pycache__" in path.split("/")]


def test_hadolint_finds_nothing():
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_declares_bind_to_port_and_leaves_offline_mode_to_the_launcher():
    steps = instructions(DOCKERFILE.read_text())
    labels = " ".join(arguments for keyword, arguments in steps if keyword == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    assert "com.amazonaws.sagemaker.capabilities.multi-models=true" in labels  # SageMaker MME (docs/lmi.md)
    assert not [arguments for keyword, arguments in steps if keyword in ("ENV", "ARG") and "HF_HUB_OFFLINE" in arguments]
    assert steps[-1] == ("CMD", '["serve"]')


def test_every_run_line_is_posix_sh():
    # podman and buildah build the OCI format by default, which has no SHELL: each RUN is `/bin/sh -c`
    # (dash on Debian and Ubuntu bases). With no SHELL here, test_hadolint_finds_nothing's shellcheck reads
    # every RUN as sh too (SC3xxx: a bash feature), and docker runs what podman runs.
    assert not [arguments for keyword, arguments in instructions(DOCKERFILE.read_text()) if keyword == "SHELL"]
    for run in RUNS:
        parsed = subprocess.run(["dash", "-n", "-c", run], capture_output=True, text=True)
        assert parsed.returncode == 0, f"RUN {run}\n{parsed.stderr}"


def _fake(folder: Path, name: str, script: str) -> None:
    (folder / name).write_text(f"#!/bin/sh\n{script}\n")
    (folder / name).chmod(0o755)


@pytest.mark.parametrize(("python_ok", "gomp", "installed"), [
    (True, True, None),  # python:* bases: nothing to install, apt-get not run
    (True, False, "libgomp1"),  # slim bases
    (False, False, "python3 python3-venv libgomp1"),  # CUDA's Ubuntu, a bare Debian
])
def test_the_first_run_line_installs_what_the_base_lacks_under_sh(tmp_path, python_ok, gomp, installed):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "python3", "exit 0" if python_ok else "exit 1")
    libs = "\tlibgomp.so.1 (libc6,x86-64) => /lib/libgomp.so.1" if gomp else "\tlibc.so.6 (libc6) => /lib/libc.so.6"
    _fake(bin_dir, "ldconfig", f"printf '%s\\n' '{libs}'")
    _fake(bin_dir, "apt-get", f'echo "$*" >> {tmp_path}/apt.log')
    (first,) = [run for run in RUNS if "apt-get" in run]
    assert "/var/lib/apt/lists/*" in first  # cleaned in tmp_path below, not on this machine
    done = subprocess.run(["/bin/sh", "-c", first.replace("/var/lib/apt/lists/*", f"{tmp_path}/lists/*")],
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines() if (tmp_path / "apt.log").exists() else []
    assert calls == ([] if installed is None else ["update", f"install -y --no-install-recommends {installed}"])


def test_the_container_test_builds_in_the_builders_default_format():
    # `--format docker` keeps SHELL, which a user's `podman build .` (OCI) ignores: it hid a bash RUN line.
    script = (ROOT / "scripts" / "test-container").read_text()
    (build,) = [line for line in script.splitlines() if '"${PODMAN[@]}" build' in line]
    assert "--format" not in build
