"""The built wheel, installed into a fresh virtual environment, serves the embedded defaults: the built-in
handlers and the default model folders are package data (pyproject.toml), loaded by path, so a checkout
alone would not notice one missing from the wheel.

The fresh venv sees the project venv's dependencies (torch, transformers, the model packages) through a
.pth line naming its site-packages; .pth files inside that folder are not processed from there, so the
project's editable install of lmi-serve (a finder that a .pth file installs) is not active, and lmi_serve
can only come from the wheel."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import requests

from server_process import ROOT, process_env, serving

pytestmark = pytest.mark.integration

TEXT_MODEL, EMBEDDING_MODEL, TENSOR_MODEL = "smollm2-135m-instruct", "all-minilm-l6-v2", "simple"
PACKAGE_DATA = [
    "lmi_serve/serving/handlers/huggingface.py",
    "lmi_serve/serving/handlers/embeddings.py",
    f"lmi_serve/serving/defaults/{TEXT_MODEL}/serving.properties",
    f"lmi_serve/serving/defaults/{EMBEDDING_MODEL}/serving.properties",
    f"lmi_serve/serving/defaults/{TENSOR_MODEL}/serving.properties",
    f"lmi_serve/serving/defaults/{TENSOR_MODEL}/model.py",
]


def run(*command, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's sources (an in-tree build writes build/ into it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "--disable-pip-version-check", "--wheel-dir", tmp / "dist", source)
    [built] = (tmp / "dist").glob("lmi_serve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv with the wheel installed, and the project venv's site-packages on its path."""
    root = tmp_path_factory.mktemp("venv") / "fresh"
    run(sys.executable, "-m", "venv", "--without-pip", root)
    python = root / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    dependencies = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "project_dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "--disable-pip-version-check", wheel)
    share_compiled_kernels(site / "lmi_serve")
    return root


def share_compiled_kernels(package: Path) -> None:
    """The checkout's numba cache (written by the servers started earlier) beside the installed kernels, as the
    image build leaves one: numba keys it by the source's hash and the CPU, not the path, so the fresh server
    loads what is still current instead of compiling it again (~30 s of a 2-core suite); stale or missing
    entries are compiled as on any first start."""
    for built in (ROOT / "src" / "lmi_serve").glob("kernels/**/__pycache__/*.nb[ic]"):
        target = package / built.parent.relative_to(ROOT / "src" / "lmi_serve") / built.name
        target.parent.mkdir(exist_ok=True)
        shutil.copy2(built, target)


def test_the_wheel_holds_the_handlers_and_the_defaults(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [name for name in PACKAGE_DATA if name not in names] == []


def test_lmi_serve_imports_from_the_fresh_venv_not_the_checkout(venv, tmp_path):
    found = run(venv / "bin" / "python", "-c", "import lmi_serve; print(lmi_serve.__file__)",
                cwd=tmp_path, env=process_env()).stdout.strip()
    assert Path(found).is_relative_to(venv) and not Path(found).is_relative_to(ROOT), found


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_the_installed_wheel_serves_the_default_models(venv, tmp_path):
    with serving(python=str(venv / "bin" / "python"), cwd=tmp_path) as server:
        ping = requests.get(server.url("/ping"), timeout=30).json()
        assert ping == {name: {"status": "Healthy"} for name in (TEXT_MODEL, EMBEDDING_MODEL, TENSOR_MODEL)}

        text = requests.post(server.url("/invocations"), timeout=180,
                             json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
        assert text.status_code == 200, text.text
        assert "Paris" in text.json()["generated_text"]

        sentences = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today."]
        embedded = requests.post(server.url("/invocations"), params={"model_name": EMBEDDING_MODEL}, timeout=180,
                                 json={"inputs": sentences})
        assert embedded.status_code == 200, embedded.text
        vectors = embedded.json()
        assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
        assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
        assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
