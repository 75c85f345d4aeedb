"""The Q4 kernel (kernels/cpu/q4_kernel.py): a GGUF's Q4 weights times bf16 rows on AVX-512 BF16.

- its layout holds the GGUF's Q4_1 / Q4_0 weights exactly (gguf's own quantizer and dequantizer as the
  reference), outputs past a whole tile included;
- its product is the bf16 input's exact product (fp64) with those weights, rounded once to bf16: within
  half a bf16 step, where torch's int4 kernel (bf16 scales) is not;
- a row's output is the same bits alone or in any batch (rows go four at a time, a last
  two or one on their own loops);
- a tensor it cannot read is refused, not read out of bounds.
Skipped where the CPU has no AVX-512 BF16 (bf16 Q4 layers then keep torch's int4 kernel: test_quantize.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lmi_serve.kernels.cpu import q4_kernel
from lmi_serve.kernels.host import cpu_has
from lmi_serve.kernels.registry import KERNELS
from lmi_serve.kernels.layers.gguf_linears import unpack_q4_blocks
from lmi_serve.kernels.host import omp_layer_loads

pytestmark = pytest.mark.skipif(not (cpu_has(*KERNELS["q4"].cpu_features) and omp_layer_loads()),
                                reason="no AVX-512 BF16 (or numba's OpenMP layer) here")


def test_it_compiles_and_passes_its_self_check_on_a_cpu_with_avx512_bf16():
    assert q4_kernel.kernel() is not None


def gguf_layer(rows: int, columns: int, qtype=gguf.GGMLQuantizationType.Q4_1, seed: int = 0):
    """A random layer through gguf's quantizer, in the kernel's layout, and its dequantized weights."""
    weight = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weight, qtype)
    blocks = unpack_q4_blocks(raw, qtype.name)
    return q4_kernel.pack(blocks.q, blocks.scale, blocks.zero), gguf.quants.dequantize(raw, qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0])
def test_the_layout_holds_the_ggufs_weights_exactly(qtype):
    for rows in (64, 40):  # whole tiles, and a tile's outputs past the layer
        weights, dequantized = gguf_layer(rows, 96, qtype)
        assert np.array_equal(q4_kernel.unpacked(weights), dequantized)


def exact_product(x: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    return x.double() @ torch.from_numpy(weights).double().T


def within_half_a_bf16_step(got: torch.Tensor, exact: torch.Tensor) -> bool:
    # half of bf16's step at each value (2^-8 relative), plus what fp32 sums of ~1,500 products can add
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6 * exact.abs().max()).all())


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0])
def test_the_product_is_the_exact_product_rounded_once_to_bf16(qtype):
    weights, dequantized = gguf_layer(80, 1536, qtype, seed=2)
    x = torch.randn(9, 1536).to(torch.bfloat16)
    got = weights(x)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 80)
    exact = exact_product(x, dequantized)
    assert within_half_a_bf16_step(got, exact), (got.double() - exact).abs().max()
    # why not torch's int4 kernel: its bf16 scales and zeros round the weights themselves
    raw = gguf.quants.quantize(np.random.default_rng(2).normal(size=(80, 1536)).astype(np.float32) * 0.05, qtype)
    blocks = unpack_q4_blocks(raw, qtype.name)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(blocks.q.astype(np.int32)), 1)
    scale_zero = torch.from_numpy(np.ascontiguousarray(np.stack([blocks.scale.T, blocks.zero.T], -1))).bfloat16()
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)
    assert not within_half_a_bf16_step(theirs, exact), "premise: torch's int4 kernel is further off"


def test_a_rows_output_does_not_depend_on_the_batch():
    weights, _ = gguf_layer(96, 128, seed=1)
    x = torch.randn(11, 128).to(torch.bfloat16)
    alone = torch.cat([weights(x[i:i + 1].contiguous()) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 6, 8, 9, 11):
        assert torch.equal(weights(x[:rows]), alone[:rows]), rows


def test_zero_rows_and_outliers_stay_finite():
    weights, dequantized = gguf_layer(32, 128)
    x = torch.zeros(2, 128)
    x[1, 5] = 3072.0
    got = weights(x.to(torch.bfloat16)).double()
    assert torch.equal(got[0], torch.zeros(32, dtype=torch.float64)) and torch.isfinite(got).all()
    assert within_half_a_bf16_step(got[1:], exact_product(x[1:].to(torch.bfloat16), dequantized))


def test_a_tensor_the_kernel_cannot_read_is_refused():
    weights, _ = gguf_layer(32, 128)
    for bad in (torch.randn(2, 128), torch.randn(2, 64).to(torch.bfloat16),
                torch.randn(128, 2).to(torch.bfloat16).t(), torch.randn(0, 128).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="takes contiguous bf16"):
            weights(bad)


def test_blocks_it_cannot_take_are_refused_when_packing():
    with pytest.raises(ValueError, match="blocks of 32"):
        q4_kernel.pack(np.zeros((4, 96), np.uint8), np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
