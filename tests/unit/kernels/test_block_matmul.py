"""The block kernel (kernels/cpu/block_matmul.py, wide_kernel.py): a GGUF's Q5_0, Q6_K and Q8_0 weights, and stacks
mixing them with Q4 blocks, times bf16 rows on AVX-512 BF16.

- unpacked, each format is exactly what gguf's own dequantizer makes of the same bytes;
- the kernel's product is the bf16 input's exact product (fp64) with those weights (gguf.quants.dequantize),
  rounded once to bf16: within half a bf16 step, as the Q4 kernel's (test_q4_kernel.py);
- a row's output is the same bits alone or in any batch (rows go four, two and one at a time), and a stack of
  parts in different formats gives each part's own layer's bits;
- what the kernel cannot read is refused.
Skipped where the CPU has no AVX-512 BF16 (the layers then keep the VNNI kernel or their loaded weights).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lmi_serve.kernels.cpu import block_matmul, wide_kernel
from lmi_serve.kernels.host import cpu_has, omp_layer_loads
from lmi_serve.kernels.layers.block_linears import BlockLinear, CodeBlocks, codes_of, unpack_q6_k_blocks
from lmi_serve.kernels.layers.gguf_linears import unpack_q4_blocks, unpack_q8_blocks
from lmi_serve.kernels.registry import KERNELS

from test_q4_kernel import exact_product, within_half_a_bf16_step

pytestmark = pytest.mark.skipif(not (cpu_has(*KERNELS["block_bf16"].cpu_features) and omp_layer_loads()),
                                reason="no AVX-512 BF16 (or numba's OpenMP layer) here")
Q5_0, Q6_K, Q8_0 = (gguf.GGMLQuantizationType[name] for name in ("Q5_0", "Q6_K", "Q8_0"))


def random_q6_k_bytes(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes (gguf has no Q6_K quantizer): every code, scale and sign; d small and finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, columns // 256, 210), dtype=np.uint8)
    raw[..., 208:] = rng.uniform(1e-4, 1e-3, (rows, columns // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_layer(qtype, rows: int, columns: int, seed: int = 0) -> tuple[CodeBlocks, np.ndarray]:
    """A random layer's blocks of `qtype` (through gguf's quantizer where it has one) and gguf's dequantized weights."""
    if qtype == Q6_K:
        raw = random_q6_k_bytes(rows, columns, seed)
        blocks = unpack_q6_k_blocks(raw)
    else:
        weight = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(weight, qtype)
        blocks = codes_of(unpack_q8_blocks(raw, qtype.name), qtype.name)
    return blocks, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def test_it_compiles_and_passes_its_self_check():
    assert block_matmul.kernel() is not None, block_matmul._compiled.error


@pytest.mark.parametrize("qtype", [Q5_0, Q6_K, Q8_0])
def test_the_codes_are_the_ggufs_weights_exactly(qtype):
    blocks, dequantized = gguf_layer(qtype, 16, 512, seed=3)
    assert np.array_equal(blocks.dequantize().numpy(), dequantized)


@pytest.mark.parametrize("qtype", [Q5_0, Q6_K, Q8_0])
def test_the_product_is_the_exact_product_rounded_once_to_bf16(qtype):
    blocks, dequantized = gguf_layer(qtype, 80, 1536, seed=2)  # 80 outputs: a padded last tile
    x = torch.randn(9, 1536).to(torch.bfloat16)
    got = BlockLinear([blocks], None)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 80)
    exact = exact_product(x, dequantized)
    assert within_half_a_bf16_step(got, exact), (got.double() - exact).abs().max()


def mixed_layer() -> tuple[list, np.ndarray]:
    """q (Q5_0), k (Q4_1), v (Q8_0) and a Q6_K part: one stack of every format, and its dequantized weights."""
    q, wq = gguf_layer(Q5_0, 64, 512, seed=4)
    weight = np.random.default_rng(5).normal(size=(32, 512)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1)
    k, wk = unpack_q4_blocks(raw, "Q4_1"), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    v, wv = gguf_layer(Q8_0, 32, 512, seed=6)
    down, wd = gguf_layer(Q6_K, 48, 512, seed=7)
    return [q, k, v, down], np.concatenate([wq, wk, wv, wd])


def test_a_stack_of_formats_is_each_parts_own_layer_bit_for_bit_and_rows_do_not_depend_on_the_batch():
    parts, dequantized = mixed_layer()
    stacked = BlockLinear(parts, None)
    assert stacked.kernel_weights.formats == ["Q5_0", "Q4", "Q8_0", "Q6_K"]
    x = torch.randn(11, 512).to(torch.bfloat16)
    separate = torch.cat([BlockLinear([part], None)(x) for part in parts], dim=1)
    assert torch.equal(stacked(x), separate)
    assert within_half_a_bf16_step(stacked(x), exact_product(x, dequantized))
    alone = torch.cat([stacked(x[i:i + 1].contiguous()) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 6, 7, 8, 11):  # four-, two- and one-row loops in every mix
        assert torch.equal(stacked(x[:rows]), alone[:rows]), rows


def test_zero_rows_give_zeros():
    parts, _ = mixed_layer()
    assert torch.equal(BlockLinear(parts, None)(torch.zeros(3, 512, dtype=torch.bfloat16)),
                       torch.zeros(3, 176, dtype=torch.bfloat16))


def test_what_the_kernel_cannot_read_is_refused():
    blocks, _ = gguf_layer(Q5_0, 32, 128)
    layer = BlockLinear([blocks], None)
    for bad in (torch.randn(2, 128), torch.randn(2, 64).to(torch.bfloat16),
                torch.randn(128, 2).to(torch.bfloat16).t(), torch.randn(0, 128).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="takes contiguous bf16"):
            layer.kernel_weights(bad)
    with pytest.raises(ValueError, match="blocks of 32"):
        wide_kernel.pack("Q5_0", np.zeros((4, 96), np.uint8), np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="do not run on the block kernel"):  # a part short of a whole tile, not last
        BlockLinear([gguf_layer(Q8_0, 16, 128)[0], blocks], None)
    assert BlockLinear([gguf_layer(Q5_0, 16, 128)[0], blocks], None).kernel_weights.formats == ["Q5_0"], \
        "neighbours of one format are one part"
