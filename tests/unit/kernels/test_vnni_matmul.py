"""The VNNI kernel (kernels/cpu/vnni_matmul.py): a GGUF's Q8_0 weights times int16 activations.

- its layout holds the GGUF's weights exactly (gguf's own quantizer and dequantizer as the reference);
- its product is the exact product of the int16-rounded activations and those weights, up to fp32
  summation order and the bf16 output's rounding, and as close to the bf16 input's exact product as a
  bf16 result can be;
- a row's output is the same bits alone or in any batch;
- a tensor it cannot read is refused, not read out of bounds.
Skipped where the CPU has no AVX-512 VNNI (Q8_0 layers then keep their loaded weights: test_quantize.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lmi_serve.kernels.cpu import vnni_matmul
from lmi_serve.kernels.host import cpu_has
from lmi_serve.kernels.registry import KERNELS
from lmi_serve.kernels.layers.gguf_linears import unpack_q8_blocks
from lmi_serve.kernels.host import omp_layer_loads

pytestmark = pytest.mark.skipif(not (cpu_has(*KERNELS["q8_vnni"].cpu_features) and omp_layer_loads()), reason="no AVX-512 VNNI (or numba's OpenMP layer) here")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def packed_layer(rows: int, columns: int, seed: int = 0):
    """A random layer through gguf's Q8_0 quantizer, in the kernel's layout, and its dequantized weights."""
    weight = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weight, Q8_0)
    blocks = unpack_q8_blocks(raw)
    return vnni_matmul.pack(blocks.q, blocks.scale), gguf.quants.dequantize(raw, Q8_0).astype(np.float32)


def test_the_layout_holds_the_ggufs_weights_exactly():
    packed, weights = packed_layer(48, 192)
    assert np.array_equal(vnni_matmul.unpacked(*packed), weights)


def test_the_product_is_the_int16_activations_times_the_weights():
    packed, weights = packed_layer(80, 256)
    x = torch.randn(9, 256).to(torch.bfloat16)
    got = vnni_matmul.matmul(x, *packed).float()
    quantized, scales = vnni_matmul.quantized_rows(x.float().numpy())
    exact = torch.from_numpy((quantized.astype(np.float32) * np.repeat(scales, 32, axis=1)) @ weights.T)
    # fp32 sums in another order, then one bf16 rounding (2^-8 of the value)
    assert torch.allclose(got, exact, rtol=2**-7, atol=1e-4 * float(exact.abs().max())), (got - exact).abs().max()
    plain = x.float() @ torch.from_numpy(weights).T  # the bf16 input's exact product: one bf16 rounding away
    assert torch.allclose(got, plain, rtol=2**-7, atol=1e-3 * float(plain.abs().max())), (got - plain).abs().max()
    assert not np.array_equal(quantized.astype(np.float32) * np.repeat(scales, 32, axis=1), x.float().numpy()), \
        "premise: the int16 activations round"


def test_a_rows_output_does_not_depend_on_the_batch():
    packed, _ = packed_layer(64, 128, seed=1)
    x = torch.randn(11, 128).to(torch.bfloat16)
    alone = torch.cat([vnni_matmul.matmul(x[i:i + 1].contiguous(), *packed) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 11):
        assert torch.equal(vnni_matmul.matmul(x[:rows], *packed), alone[:rows]), rows


def test_zero_and_outlier_blocks_quantize_without_nan():
    packed, weights = packed_layer(16, 128)
    x = torch.zeros(2, 128)
    x[1, 5] = 3072.0  # one block's scale set by an outlier, the others all zero
    got = vnni_matmul.matmul(x.to(torch.bfloat16), *packed).float()
    assert torch.equal(got[0], torch.zeros(16)) and torch.isfinite(got).all()
    assert torch.allclose(got[1], 3072.0 * torch.from_numpy(weights[:, 5]), rtol=2**-7, atol=1e-3)


def test_a_tensor_the_kernel_cannot_read_is_refused():
    packed, _ = packed_layer(16, 128)
    for bad in (torch.randn(2, 128), torch.randn(2, 64).to(torch.bfloat16),
                torch.randn(128, 2).to(torch.bfloat16).t()):
        with pytest.raises(ValueError, match="takes contiguous bf16"):
            vnni_matmul.matmul(bad, *packed)


def test_blocks_it_cannot_take_are_refused_when_packing():
    with pytest.raises(ValueError, match="blocks of 32"):
        vnni_matmul.pack(np.zeros((4, 96), np.int8), np.ones((4, 2), np.float32))
