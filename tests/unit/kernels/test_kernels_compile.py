"""Every numba kernel compiles where what it needs is here.

A kernel that fails to compile or fails its start-up self-check is not an error in production: the layer
falls back (oneDNN, torch's int4 kernel, SDPA) and one log line says so. Each kernel's own tests then skip,
so a kernel broken by a numba, llvmlite or torch upgrade would go unnoticed, slower but green. These
tests turn that into a failure wherever the kernel's needs are met: numba's OpenMP layer loads (the layer
every kernel requires) and, for the AVX-512 kernels, the CPU has their features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lmi_serve.kernels.cpu import decode_kernel
from lmi_serve.kernels.cpu import layer_chain, norm_kernel, q4_chain, q4_kernel, rotary_kernel, row_kernel, vnni_matmul
from lmi_serve.kernels.layers.linear_kernels import onednn_available
from lmi_serve.kernels.cpu.numba_bits import omp_layer_loads


pytestmark = pytest.mark.skipif(not omp_layer_loads(), reason="numba's OpenMP layer does not load here")


def _why(module: Any) -> str:
    compiled = getattr(module, "_compiled", None)
    error = getattr(compiled, "error", None)
    return f"{module.__name__} did not compile: {error or 'see its log line'}"


# numba and its OpenMP layer are all these need (any x86-64 CPU; the norm kernel picks torch's lane count)
PORTABLE: dict[str, tuple[Any, Callable[[], Any]]] = {
    "norm": (norm_kernel, norm_kernel.kernel),
    "rotary": (rotary_kernel, rotary_kernel.kernel),
    "decode attention": (decode_kernel, decode_kernel.kernel),
    "row": (row_kernel, row_kernel.kernel),
    "layer chain": (layer_chain, layer_chain.kernel),
}


@pytest.mark.parametrize("name", PORTABLE)
def test_portable_kernel_compiles(name):
    if name in ("row", "layer chain") and not onednn_available():
        pytest.skip("the row kernel's layers are oneDNN's; this torch has no oneDNN")
    module, kernel = PORTABLE[name]
    assert kernel() is not None, _why(module)


@pytest.mark.skipif(not vnni_matmul.cpu_fits(), reason="no AVX-512 VNNI on this CPU")
def test_vnni_kernel_compiles_on_a_vnni_cpu():
    assert vnni_matmul.available(), _why(vnni_matmul)


@pytest.mark.skipif(not q4_kernel.cpu_fits(), reason="no AVX-512 BF16 on this CPU")
def test_q4_kernel_and_its_chain_compile_on_a_bf16_cpu():
    assert q4_kernel.available(), _why(q4_kernel)
    assert q4_chain.kernel() is not None, _why(q4_chain)
