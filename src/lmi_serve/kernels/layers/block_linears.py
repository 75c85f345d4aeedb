"""Linear layers on a GGUF's Q5_0, Q6_K and Q8_0 blocks, and on stacks that mix them with Q4 blocks, with bf16
activations (kernels/cpu/block_matmul.py; kernels/layers/quantize.py swaps them in).

A Q4_K_M file of a model whose widths are not multiples of 256 holds few Q4_K layers: llama-quantize falls back
to Q5_0 (SmolLM2-135M: every 576-wide input), keeps Q6_K for ffn_down in about half the layers and Q8_0 for
some attn_v. Each is run on its own blocks, their fp16 scales kept: ~0.69 bytes a weight for Q5_0 (the VNNI
kernel's int8 form: 1.06; the bf16 copy: 2), 0.88 for Q6_K. q/k/v whose formats differ stack as one layer of
parts. As the Q4 layers: up to the kernel's rows on it, more on `dense` (the loaded weights on oneDNN), and a
row's output does not depend on the others in the batch (the dense copy's does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmi_serve.kernels.cpu import block_matmul, q4_kernel, wide_kernel
from lmi_serve.kernels.layers.gguf_linears import GROUP, FewRowsLinear, Q4Blocks, Q8Blocks, fp16_fits
from lmi_serve.kernels.registry import max_rows

KINDS = tuple(wide_kernel.KINDS)  # the GGUF block types with a form here: Q5_0, Q6_K, Q8_0
_Q6_K_BYTES = 128 + 64 + 16 + 2  # per 256 weights: low nibbles, high bit pairs, int8 scales, fp16 d


@dataclass(frozen=True)
class CodeBlocks:
    """One layer's blocks of wider codes, unpacked: weight[n, k] = d[n, k // 32] sc[n, k // 16] (q[n, k] - offset)
    (sc only for Q6_K), offset 16 (Q5_0), 32 (Q6_K) or 128 (Q8_0: q the int8 plus 128)."""

    kind: str  # one of KINDS
    q: np.ndarray  # [N, K] uint8
    d: np.ndarray  # [N, K / 32] float32 (the GGUF's fp16; Q6_K: its super-block's, repeated)
    sc: np.ndarray | None = None  # [N, K / 16] int8 (Q6_K)

    @staticmethod
    def concatenated(parts: list[CodeBlocks]) -> CodeBlocks:
        """The blocks of one layer whose rows are `parts`' rows (one kind), one after the other."""
        sc = None if parts[0].sc is None else np.concatenate([p.sc for p in parts])
        return CodeBlocks(parts[0].kind, np.concatenate([p.q for p in parts]), np.concatenate([p.d for p in parts]),
                          sc)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] weight in fp32 (d sc rounded as the GGUF's dequantizer does: exact, then one product)."""
        scale = np.repeat(self.d, GROUP, axis=1)
        if self.sc is not None:
            scale = scale * np.repeat(self.sc.astype(np.float32), 16, axis=1)
        offset = wide_kernel.OFFSETS[wide_kernel.KINDS[self.kind]]
        return torch.from_numpy(scale * (self.q.astype(np.float32) - offset))

    def permuted(self, undo) -> CodeBlocks:
        return CodeBlocks(self.kind, undo(self.q), undo(self.d), None if self.sc is None else undo(self.sc))


def codes_of(blocks: Q8Blocks, kind: str) -> CodeBlocks:
    """Int8 blocks (gguf_linears.unpack_q8_blocks) as codes: a Q8_0 layer's (q + 128), a Q5_0 one's (q + 16)."""
    offset = 128 if kind == "Q8_0" else 16
    return CodeBlocks(kind, (blocks.q.astype(np.int16) + offset).astype(np.uint8), blocks.scale)


def unpack_q6_k_blocks(raw: np.ndarray) -> CodeBlocks:
    """A GGUF Q6_K tensor's bytes ([N, K/256 * 210] uint8) as CodeBlocks, exactly.

    Super-block layout (ggml): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per
    16 weights), fp16 d. Each half of 128 weights takes 64 low-nibble bytes (byte j: weight j in its low
    nibble, j + 64 in its high one) and 32 high-bit bytes (byte i: bits 2t, 2t + 1 the high bits of weight
    32 t + i)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _Q6_K_BYTES)
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 64)
    nibbles = np.concatenate([low & 15, low >> 4], axis=3).reshape(rows, -1, 2, 128)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    pairs = ((high >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3).reshape(rows, -1, 2, 128)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, super-blocks]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1)
    return CodeBlocks("Q6_K", (nibbles | pairs << 4).reshape(rows, -1), np.repeat(d, 8, axis=1), sc)


def block_fits(in_features: int, dtype: torch.dtype) -> bool:
    """Whether a layer this wide, computing in `dtype`, can run on the block kernel here."""
    return dtype == torch.bfloat16 and in_features % GROUP == 0 and block_matmul.kernel() is not None


def _part(blocks: Q4Blocks | CodeBlocks) -> tuple[int, torch.Tensor, int]:
    if isinstance(blocks, Q4Blocks):
        return block_matmul.Q4, q4_kernel.pack(blocks.q, blocks.scale, blocks.zero).packed, blocks.q.shape[0]
    packed = wide_kernel.pack(blocks.kind, blocks.q, blocks.d, blocks.sc)
    return wide_kernel.KINDS[blocks.kind], torch.from_numpy(packed), blocks.q.shape[0]


def _format(blocks: Q4Blocks | CodeBlocks | None) -> str | None:
    return None if blocks is None else "Q4" if isinstance(blocks, Q4Blocks) else blocks.kind


def merged(parts: list[Q4Blocks | CodeBlocks]) -> list[Q4Blocks | CodeBlocks] | None:
    """`parts` with neighbours of one format joined, or None where the block kernel cannot hold them as one layer:
    a Q4 part in another column order or whose scales overflow fp16, or a part before the last that does not
    fill whole tiles of 32 outputs."""
    joined: list[list] = []
    for blocks in parts:
        if isinstance(blocks, Q4Blocks) and (blocks.columns is not None or not fp16_fits(blocks)):
            return None
        last = joined[-1][-1] if joined else None
        if _format(last) == _format(blocks):
            joined[-1].append(blocks)
        else:
            joined.append([blocks])
    result = [group[0].concatenated(group) if len(group) > 1 else group[0] for group in joined]
    if any(blocks.q.shape[0] % block_matmul.TILE for blocks in result[:-1]):
        return None
    return result


class BlockLinear(FewRowsLinear):
    """`nn.Linear` on parts of GGUF blocks (CodeBlocks, or Q4Blocks beside them; `merged`) with bf16 activations:
    up to the block kernel's rows on it, more on `dense`. Only where `block_fits`."""

    max_rows = max_rows("block_bf16")

    def __init__(self, parts: list[Q4Blocks | CodeBlocks], bias: torch.Tensor | None, dense: nn.Module | None = None):
        super().__init__()
        joined = merged(parts)
        shape = (sum(blocks.q.shape[0] for blocks in parts), parts[0].q.shape[1])
        if joined is None or not block_fits(shape[1], torch.bfloat16):
            raise ValueError("these blocks do not run on the block kernel (see block_linears.merged, block_fits)")
        self._setup(shape, bias, torch.bfloat16, dense)
        self.kernel_weights = block_matmul.BlockWeights([_part(blocks) for blocks in joined])

    def _held_bytes(self) -> int:
        return self.kernel_weights.nbytes

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernel_weights(flat)

    def extra_repr(self) -> str:
        formats = " + ".join(self.kernel_weights.formats)
        return self._describe(formats) + ", fp16 scales on the AVX-512 BF16 block kernel"
