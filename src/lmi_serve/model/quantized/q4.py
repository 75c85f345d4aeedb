"""A 4-bit `IntWeight` (AWQ, GPTQ, compressed-tensors W4A16) as the q4 path's Q4Blocks, losslessly.

The formats store w = (code - z) * s per group; the q4 kernels take w = (q - 8) * scale + zero per block of
32 input columns. So q = code, scale = s and zero = (8 - z) * s, with each group's s and z repeated over its
blocks (a group of 128 is four blocks). Products of a 4-bit integer and an fp16 or bf16 scale are exact in
float32, so the blocks stand for exactly the weights `weights.dequantize` gives.

A group must fill whole blocks of 32 columns. With consecutive groups (AWQ; GPTQ without desc_act; any group
size that is a multiple of 32, or one group per channel) the columns keep their order. GPTQ's activation order
(`desc_act`, a `g_idx` that is not i // group_size) puts a group's columns anywhere; sorted by group they are
consecutive again, and the blocks keep that order in `Q4Blocks.columns` (the layer gathers its input into it).
"""

from __future__ import annotations

import numpy as np

from lmi_serve.kernels.layers.gguf_linears import GROUP, Q4Blocks
from lmi_serve.model.quantized.weights import IntWeight


def q4_blocks(weight: IntWeight) -> Q4Blocks | str:
    """`weight` as Q4Blocks, or why it has none (a reason for the start-up report)."""
    out, width = weight.shape
    if weight.bits != 4:
        return f"{weight.bits}-bit codes (the q4 kernels take 4-bit ones)"
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
    return Q4Blocks(np.ascontiguousarray(codes if identity else codes[:, order]),
                    np.ascontiguousarray(scales, dtype=np.float32),
                    np.ascontiguousarray((8 - zeros) * scales, dtype=np.float32),
                    None if identity else order.astype(np.int64))
