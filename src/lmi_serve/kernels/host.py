"""The one probe of this host: what the kernels need to know about the machine, asked once.

`probe()` answers, and caches, a `Host`: the CPU's features as LLVM names them (avx512bf16, avx512vnni, ...),
numba's version and whether its OpenMP threading layer loads, whether torch has oneDNN's packed-weight
linear and whether oneDNN computes bf16 in hardware (avx512_bf16 or AMX) or emulates it, and the CUDA device
and its capability. The registry's host needs (kernels/registry.py) are checked against it; the plan
(kernels/plan.py) reports it.

The first probe also sets numba's threading layer to OpenMP, once for the process: the kernels' parallel
loops then run on an OpenMP pool, where numba's default workqueue layer starts threads of its own that fight
torch's (kernels/cpu/decode_kernel.py measured it). The pool is not torch's own: numba's OpenMP layer links the
system's libgomp by its file name (libgomp.so.1.0.0) and torch loads its bundled copy, so a process holds two
pools that take turns. One pool for both (that name made to resolve to torch's copy) was measured no faster in
a 32-row bf16 step (benchmarks/journal/2026-12.md). Every kernel's compile calls `omp_threads()`
first, which probes (so sets it) and says whether the layer loads.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import asdict, dataclass

import torch

from lmi_serve.kernels.registry import CPU_FEATURES

try:
    import numba
    from llvmlite import binding as llvm_binding
except ImportError:  # pragma: no cover - a dependency; without it no numba kernel runs
    numba = None


@dataclass(frozen=True)
class Host:
    """What this machine offers the kernels (module docstring)."""

    cpu_features: tuple[str, ...]  # LLVM's names of the CPU's features that are on, sorted
    numba: str | None  # numba's version; None where it is not installed
    omp_layer: bool  # numba's OpenMP threading layer loads (its libgomp is found)
    onednn: bool  # torch has oneDNN's packed-weight linear ops
    bf16_native: bool  # oneDNN computes bf16 in hardware (avx512_bf16 or AMX), not widened to fp32
    cuda: str | None = None  # the CUDA device's name, where one is visible
    cuda_capability: tuple[int, int] | None = None

    def has(self, *features: str) -> bool:
        """Whether the CPU has every one of `features` (LLVM's names) and numba can compile for them."""
        return self.numba is not None and all(name in self.cpu_features for name in features)

    def describe(self) -> dict:
        """For the plan's report (the log line and GET /models/<m>): the features the registry asks about only."""
        shown = asdict(self)
        shown["cpu_features"] = [name for name in self.cpu_features if name in CPU_FEATURES]
        shown["bf16"] = "native" if shown.pop("bf16_native") else "emulated"
        return shown


def _cpu_features() -> tuple[str, ...]:
    if numba is None:
        return ()
    return tuple(sorted(name for name, on in llvm_binding.get_host_cpu_features().items() if on))


def _omp_layer_loads() -> bool:
    if numba is None:
        return False
    try:
        importlib.import_module("numba.np.ufunc.omppool")
    except ImportError:  # its OpenMP library (libgomp) is missing
        return False
    return True


def _onednn() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


def _bf16_native() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cuda() -> tuple[str | None, tuple[int, int] | None]:
    if not torch.cuda.is_available():
        return None, None
    return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))


@functools.cache
def probe() -> Host:
    """This host, probed on the first call (cached for the process); sets numba's threading layer (module docstring)."""
    if numba is not None:
        numba.config.THREADING_LAYER = "omp"  # the one place it is set
    cuda, capability = _cuda()
    return Host(cpu_features=_cpu_features(), numba=getattr(numba, "__version__", None),
                omp_layer=_omp_layer_loads(), onednn=_onednn(), bf16_native=_bf16_native(), cuda=cuda,
                cuda_capability=capability)


def omp_threads() -> None:
    """Before compiling a parallel kernel: raise unless numba is installed and its OpenMP layer loads here."""
    host = probe()
    if host.numba is None:
        raise RuntimeError("numba is not installed")
    if not host.omp_layer:
        raise RuntimeError("numba's OpenMP threading layer does not load here (libgomp missing)")


def require_omp_layer() -> None:
    """After compiling one: raise unless its parallel loops really run on numba's OpenMP layer."""
    if numba.threading_layer() != "omp":
        raise RuntimeError(f"numba's threading layer is {numba.threading_layer()}, not omp")


# The probe's answers as functions, for the call sites that ask one question.
def cpu_has(*features: str) -> bool:
    return probe().has(*features)


def omp_layer_loads() -> bool:
    return probe().omp_layer


def onednn_available() -> bool:
    return probe().onednn


def bf16_native() -> bool:
    return probe().bf16_native
