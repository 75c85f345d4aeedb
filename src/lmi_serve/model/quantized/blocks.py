"""A pre-quantized layer's `IntWeight` as the kernels' blocks, losslessly: Q4Blocks for 4-bit codes (AWQ, GPTQ,
compressed-tensors W4A16), Q8Blocks for symmetric 8-bit ones (compressed-tensors W8A8 / W8A16, GPTQ 8-bit).

The formats store w = (code - z) * s per group. The q4 kernels take w = (q - 8) * scale + zero per block of 32
input columns, so q = code, scale = s and zero = (8 - z) * s; the Q8_0 kernel takes w = q * scale with q int8,
so an 8-bit layer needs z = 128 (its codes are the int8 values plus 128: symmetric) and q = code - 128. Each
group's s and z repeat over its blocks (a group of 128 is four blocks; one per channel, all of them). Products
of a 4- or 8-bit integer and an fp16 or bf16 scale are exact in float32, so the blocks stand for exactly the
weights `weights.dequantize` gives (an fp32 scale, compressed-tensors' per-channel int8, is kept as it is).

A group must fill whole blocks of 32 columns. With consecutive groups (AWQ; GPTQ without desc_act) the columns
keep their order. GPTQ's activation order (`desc_act`, a `g_idx` that is not i // group_size) puts a group's
columns anywhere; sorted by group they are consecutive again, and 4-bit blocks keep that order in
`Q4Blocks.columns` (the layer gathers its input into it). The Q8 kernel has no such gather: an 8-bit layer in
activation order keeps its loaded weights.
"""

from __future__ import annotations

import numpy as np

from lmi_serve.kernels.layers.gguf_linears import GROUP, Q4Blocks, Q8Blocks
from lmi_serve.model.quantized.weights import IntWeight

_INT8_OFFSET = 128


def kernel_blocks(weight: IntWeight) -> Q4Blocks | Q8Blocks | str:
    """`weight` as the kernels' blocks, or why it has none (a reason for the start-up report)."""
    width = weight.shape[1]
    if weight.bits not in (4, 8):
        return f"{weight.bits}-bit codes (the kernels take 4- and 8-bit ones)"
    if width % GROUP:
        return f"{width} input columns, not whole blocks of {GROUP}"
    g_idx = weight.g_idx.numpy()
    order = np.argsort(g_idx, kind="stable")
    block_groups = g_idx[order].reshape(-1, GROUP)
    if not (block_groups == block_groups[:, :1]).all():
        return f"groups that do not fill whole blocks of {GROUP} columns"
    groups = block_groups[:, 0]  # the group of each block
    scales = weight.scales.numpy()[:, groups]
    zeros = weight.zeros.numpy()[:, groups]
    identity = bool((order == np.arange(width)).all())
    codes = weight.codes.numpy()
    if weight.bits == 8:
        if not identity:
            return "8-bit codes in activation order (the Q8 kernel reads columns in order)"
        if not (zeros == _INT8_OFFSET).all():
            return "asymmetric 8-bit codes (the Q8 kernel takes symmetric ones)"
        return Q8Blocks((codes.astype(np.int16) - _INT8_OFFSET).astype(np.int8),
                        np.ascontiguousarray(scales, dtype=np.float32))
    return Q4Blocks(np.ascontiguousarray(codes if identity else codes[:, order]),
                    np.ascontiguousarray(scales, dtype=np.float32),
                    np.ascontiguousarray((8 - zeros) * scales, dtype=np.float32),
                    None if identity else order.astype(np.int64))
