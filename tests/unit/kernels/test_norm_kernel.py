"""The RMSNorm kernel (kernels/cpu/norm_kernel.py): torch's `F.rms_norm` bits in one call.

- fp32 (`direct`: the weight inside) and bf16 (`upcast`: normalised in fp32, rounded, times the weight) give
  torch's bits at widths with and without its cascaded sum, and with leftover vectors and floats;
- a row's bits do not depend on the rows around it;
- a FusedRMSNorm takes it for few rows only, and only where the probe found its bits the layer's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lmi_serve.kernels.cpu import norm_kernel
from lmi_serve.kernels.layers.fused_norms import FusedRMSNorm, use_fused_norms

pytestmark = pytest.mark.skipif(norm_kernel.kernel() is None, reason="numba missing, or its sums are not torch's here")

# 17: one vector and a float left over; 100: leftover vectors; 2048 and 5000: torch's cascade fills a level
WIDTHS = (17, 64, 100, 576, 2048, 5000)


def torch_upcast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


@pytest.mark.parametrize("width", WIDTHS)
def test_fp32_rows_are_torchs_bits(width):
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator)
    for rows in (1, 3, 6):
        x = torch.randn(rows, width, generator=generator) * 3
        assert torch.equal(norm_kernel.rms_norm(x, weight, 1e-5, "direct"), F.rms_norm(x, (width,), weight, 1e-5))


@pytest.mark.parametrize("width", WIDTHS)
def test_bf16_rows_are_the_upcast_forms_bits(width):
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator).to(torch.bfloat16)
    for rows in (1, 3, 6):
        x = (torch.randn(rows, width, generator=generator) * 3).to(torch.bfloat16)
        got = norm_kernel.rms_norm(x, weight, 1e-6, "upcast")
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch_upcast(x, weight, 1e-6))


def test_a_rows_bits_do_not_depend_on_the_batch():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(576, generator=generator)
    x = torch.randn(9, 576, generator=generator)
    alone = torch.cat([norm_kernel.rms_norm(x[i:i + 1], weight, 1e-5, "direct") for i in range(9)])
    assert torch.equal(norm_kernel.rms_norm(x, weight, 1e-5, "direct"), alone)


def llama_norm(width: int, dtype: torch.dtype) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=LlamaConfig().rms_norm_eps)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_norm_takes_the_kernel_for_few_rows_with_its_own_bits(dtype, monkeypatch):
    model = torch.nn.Sequential(llama_norm(576, dtype))
    use_fused_norms(model)
    fused = model[0]
    assert isinstance(fused, FusedRMSNorm) and fused.kernel
    calls = []
    real = norm_kernel.rms_norm
    monkeypatch.setattr(norm_kernel, "rms_norm", lambda *args: calls.append(args[0].shape) or real(*args))
    own = fused._own[0]
    few = (torch.randn(1, 4, 576) * 2).to(dtype)
    many = (torch.randn(2, norm_kernel.MAX_ELEMENTS // 576, 576) * 2).to(dtype)
    with torch.inference_mode():
        assert torch.equal(fused(few), own(few)) and torch.equal(fused(many), own(many))
    assert calls == [few.shape]  # the many rows went to F.rms_norm


def test_a_norm_whose_bits_differ_keeps_f_rms_norm(monkeypatch):
    """Where the kernel's bits were not the layer's (here: made to differ), the layer never calls it."""
    from lmi_serve.kernels.layers import fused_norms

    monkeypatch.setattr(fused_norms, "_AGREES", {})
    real = norm_kernel.rms_norm
    monkeypatch.setattr(norm_kernel, "rms_norm", lambda *args: real(*args) * 1.001)
    model = torch.nn.Sequential(llama_norm(64, torch.float32))
    use_fused_norms(model)
    assert isinstance(model[0], FusedRMSNorm) and not model[0].kernel
