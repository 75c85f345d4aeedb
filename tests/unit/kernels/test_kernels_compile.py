"""Every numba kernel in kernels/registry.py compiles where what it needs is here.

A kernel that fails to compile or fails its start-up self-check is not an error in production: the layer
falls back (oneDNN, torch's int4 kernel, SDPA) and one log line says so. Each kernel's own tests then skip,
so a kernel broken by a numba, llvmlite or torch upgrade would go unnoticed, slower but green. These
tests turn that into a failure wherever the kernel's needs (the registry's `needs`, checked against
kernels/host.py's probe) are met. The list is the registry's: a kernel added there is tested here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest

import lmi_serve.kernels.cpu
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.registry import KERNELS

COMPILED = [name for name, kernel in KERNELS.items() if kernel.module.startswith("cpu.")]


def _why(module: Any) -> str:
    compiled = getattr(module, "_compiled", None)
    error = getattr(compiled, "error", None)
    return f"{module.__name__} did not compile: {error or 'see its log line'}"


@pytest.mark.parametrize("name", COMPILED)
def test_kernel_compiles_where_the_host_meets_its_needs(name):
    kernel = KERNELS[name]
    missing = kernel.missing(probe())
    if missing:
        pytest.skip(f"this host lacks {', '.join(missing)}")
    module = kernel.load()
    assert module.kernel() is not None, _why(module)


def test_every_compiled_kernel_is_in_the_registry():
    """A module of kernels/cpu/ with a `kernel()` is a kernel: the registry (and so this test) lists it."""
    listed = {kernel.module for kernel in KERNELS.values()}
    found = {f"cpu.{info.name}" for info in pkgutil.iter_modules(lmi_serve.kernels.cpu.__path__)
             if hasattr(importlib.import_module(f"lmi_serve.kernels.cpu.{info.name}"), "kernel")}
    assert found <= listed, f"kernels missing from kernels/registry.py: {sorted(found - listed)}"

