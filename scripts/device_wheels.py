"""scripts/device_check --prepare: what travels to the device machine (docs/gpu.md). The wheels of what the GPU
tests, the GPU benchmark and the server (the CPU scaling part) import beyond the device image's torch, for its
Python, and SmolLM2's tokenizer and config, into .device_wheels/ (git-ignored); the size against what one call
carries. device_check.py installs them there (`install`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".device_wheels"
MANIFEST = WHEELS / "manifest.json"
OVERLAY = Path(tempfile.gettempdir()) / "lmi-device-site"  # the wheels go here, ahead of the image's packages
LIMIT_MIB = 64  # what one device call carries: the working tree plus .device_wheels
TARGET_PYTHON = "3.12"  # the device image's python3 (Python 3.12.3, /opt/torch/.venv, as sessions saw it)
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# What the GPU tests, the GPU benchmark and the server (--cpu-scaling) import beyond torch (the image's), and why.
DEVICE_PACKAGES = {
    "pytest": "runs tests/gpu",
    "gguf": "transformers' GGUF reader: SmolLM2's GGUF, where one is given (LMI_SERVE_SMOLLM2_GGUF)",
    "psutil": "engine/kv/select.py imports it",
    "pydantic": "lmi_serve.config (option parsing: placement and memory-budget tests of issue 30 item 1)",
    "llguidance": "engine/sampling/grammar.py: grammar rows (issue 30 item 2: masks on the device)",
    "peft": "model/lora.py: LoRA rows",
    # The first device run (2026-11-26) found transformers 5.17.0 in the image, whose sdpa_attention lacks
    # pack_gqa: every engine import failed. So the pinned transformers and accelerate travel, with their needs.
    "transformers": "the pin in pyproject.toml (the image's may be older)",
    "accelerate": "the pin in pyproject.toml",
    # --cpu-scaling starts the real server (benchmarks/bench_cpu_scaling.py); the image has none of the first two
    "flask": "the HTTP server: its app (server/app.py)",
    "gunicorn": "the HTTP server: its workers (server/gunicorn_app.py), the engine replicas",
    "prometheus-client": "the HTTP server: /metrics (server/metrics.py), at the pin in pyproject.toml",
}
# The project's other dependencies, not carried: nothing the device runs imports them, or the image has them.
DROPPED = {
    "python-json-logger, swagger-ui-py": "the server imports them only for --log-format json and /docs",
    "boto3": "S3 model sources only (accelerate imports it only where it is installed)",
    "numpy": "any numpy transformers accepts; the image's torch build has its own",
    "numba, llvmlite": "the CPU kernels (kernels/cpu/): llvmlite's wheel alone is 57 MiB, more than a call carries "
                       "with the rest; the image has both (the scaling table shows its version and the kernels used)",
    "opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http": "the HTTP server's traces only (server/tracing.py)",
}
IMAGE_ROOTS = ("torch",)
NOT_CARRIED = {"numpy", "typing-extensions"}  # the image has them; their wheels are large or torch-bound
def say(text: str = "") -> None:
    print(text, flush=True)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- --prepare ---------------------------------------------------------------------------------------------


def _requirements(dist_name: str, python: str) -> list[str]:
    from importlib import metadata

    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    names = []
    for text in metadata.distribution(dist_name).requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(env):
            names.append(norm(requirement.name))
    return names


def _closure(roots, python: str) -> set[str]:
    from importlib import metadata

    seen: set[str] = set()
    todo = [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo.extend(_requirements(name, python))
    return seen


def tree_bytes() -> int:
    """What travels besides .device_wheels: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / p.decode()).stat().st_size for p in listed if p and (ROOT / p.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepare(python: str) -> int:
    from importlib import metadata

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    image = _closure(IMAGE_ROOTS, python)
    # The packages named are carried even where torch & co. depend on them too (the image may still lack them).
    # So are pydantic's own parts: here huggingface_hub 2.x pulls them into torch & co.'s closure, the image's 1.x not.
    wanted = sorted(((_closure(DEVICE_PACKAGES, python) - image) | {norm(name) for name in DEVICE_PACKAGES}
                    | _closure(["pydantic"], python)) - NOT_CARRIED)
    pins = [f"{name}=={metadata.version(name)}" for name in wanted]
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir()
    say(f"[prepare] {len(pins)} wheels for CPython {python} manylinux x86_64: {' '.join(pins)}")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", python, "--implementation", "cp", "-d", str(WHEELS)]
    for tag in PLATFORMS:
        command += ["--platform", tag]
    subprocess.run(command + pins, check=True)
    import device_models

    copied = device_models.copy_tokenizer_files(WHEELS / "smollm2")
    files = {}
    for wheel in sorted(WHEELS.glob("*.whl")):
        files[norm(wheel.name.split("-")[0])] = wheel.name
    manifest = {"python": python, "made": time.strftime("%Y-%m-%d %H:%M:%S"),
                "packages": {name: {"version": metadata.version(name), "wheel": files.get(name)} for name in wanted},
                "smollm2_files": [p.name for p in copied], "dropped": DROPPED}
    MANIFEST.write_text(json.dumps(manifest, indent=2))
    wheels, tree = folder_bytes(WHEELS), tree_bytes()
    for wheel in sorted(WHEELS.glob("*.whl"), key=lambda p: -p.stat().st_size):
        say(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    say(f"  {folder_bytes(WHEELS / 'smollm2') / 2**20:7.2f} MiB  smollm2/ (tokenizer and config: {', '.join(p.name for p in copied)})")
    say(f"[prepare] .device_wheels: {wheels / 2**20:.1f} MiB; the working tree: {tree / 2**20:.1f} MiB; "
        f"together {(wheels + tree) / 2**20:.1f} MiB of the {LIMIT_MIB} MiB a device call carries")
    for names, why in DROPPED.items():
        say(f"[prepare] not carried: {names} ({why})")
    if wheels + tree > LIMIT_MIB * 2**20:
        say("[prepare] TOO BIG for one device call")
        return 1
    return 0
