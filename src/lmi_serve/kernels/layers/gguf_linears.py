"""Linear layers on a GGUF's own quantized blocks (option.quantize=q4; kernels/layers/quantize.py swaps them in).

- Q4Linear: Q4_0 / Q4_1 blocks (w = d q + m per 32 weights, q in 0..15), and Q4_K's (w = d sc_j q - dmin m_j per
  32-weight sub-block j). With bf16 activations (option.dtype=bf16) on CPUs with AVX-512 BF16:
  kernels/cpu/q4_kernel.py, Q4_0 / Q4_1's scales kept exactly (Q4_K's d sc_j, dmin m_j rounded to fp16), ~0.7x
  torch's int4 kernel's time. Otherwise torch's x86 int4 kernel (`_weight_int4pack_mm_for_cpu`, group 32),
  which computes (q - 8) * scale + zero with scale = d, zero = m + 8d (Q4_0: w = d (q - 8), zero = 0), its
  scales and zeros in the activations' dtype: fp32 (exact relative to the GGUF; a scalar loop, slow) or bf16.
- Q8Linear: Q8_0 blocks (w = d q, q int8, per 32 weights) with bf16 activations, on kernels/cpu/vnni_matmul.py's
  kernel (CPUs with AVX-512 VNNI only): SmolLM2's tied lm_head is Q8_0 in its GGUF, and a one-row step reads
  it as 30 MB instead of a bf16 copy's 57 MB. Q5_0 as int8 too, where the block kernel does not run.

Q5_0, Q6_K, and stacks mixing formats: kernels/layers/block_linears.py (FewRowsLinear too).

More than Q4_MAX_ROWS rows go to `dense` (the loaded weights on oneDNN's bf16 matmul) where given: the
few-row kernels compute row by row (matrix-vector loops), and a GEMM wins above. Each few-row kernel
computes a row on its own: a row's output does not depend on the others in the batch (the dense copy's
does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmi_serve.kernels.cpu import q4_kernel, vnni_matmul
from lmi_serve.kernels.registry import max_rows

GROUP = 32  # weights per GGUF Q4 / Q8 block: one scale (and min) per 32 input columns
# The limits are kernels/registry.py's. bf16 q4 layers with a dense copy: more rows than Q4_MAX_ROWS go to it.
# Q8_0 layers: the VNNI kernel up to Q8_MAX_ROWS rows (level with bf16 oneDNN at 3-4, slower at 8).
Q4_MAX_ROWS = max_rows("q4")
Q8_MAX_ROWS = max_rows("q8_vnni")


@dataclass(frozen=True)
class Q4Blocks:
    """One layer's 4-bit blocks, unpacked: q in 0..15 and per-block scale and zero, so that
    weight[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32] (a GGUF's Q4 blocks; AWQ / GPTQ /
    compressed-tensors W4A16 groups, model/quantized/q4.py). `columns`, where not None, is the layer's input
    column each block column k stands for (GPTQ's activation order: the columns sorted by group so that each
    block of 32 has one scale): block column k multiplies x[..., columns[k]]."""

    q: np.ndarray  # [N, K] uint8
    scale: np.ndarray  # [N, K / 32] float32
    zero: np.ndarray  # [N, K / 32] float32
    columns: np.ndarray | None = None  # [K] int64, a permutation of 0..K-1

    @staticmethod
    def concatenated(parts: list[Q4Blocks]) -> Q4Blocks:
        """The blocks of one layer whose rows are `parts`' rows, one after the other (one column order: `stackable`)."""
        if not Q4Blocks.stackable(parts):
            raise ValueError("blocks with different column orders do not stack")
        return Q4Blocks(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("q", "scale", "zero")),
                        columns=parts[0].columns)

    @staticmethod
    def stackable(parts: list[Q4Blocks]) -> bool:
        first = parts[0].columns
        return all((p.columns is None and first is None) or
                   (p.columns is not None and first is not None and np.array_equal(p.columns, first)) for p in parts)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] weight in the layer's own column order."""
        scale = torch.from_numpy(self.scale).repeat_interleave(GROUP, dim=1)
        zero = torch.from_numpy(self.zero).repeat_interleave(GROUP, dim=1)
        blocked = (torch.from_numpy(self.q.astype(np.float32)) - 8) * scale + zero
        if self.columns is None:
            return blocked
        weight = torch.empty_like(blocked)
        weight[:, torch.from_numpy(self.columns)] = blocked
        return weight

    def permuted(self, undo) -> Q4Blocks:
        return Q4Blocks(undo(self.q), undo(self.scale), undo(self.zero), self.columns)


@dataclass(frozen=True)
class Q8Blocks:
    """One layer's GGUF Q8_0 blocks, unpacked: weight[n, k] = q[n, k] * scale[n, k // 32]."""

    q: np.ndarray  # [N, K] int8
    scale: np.ndarray  # [N, K / 32] float32 (the GGUF's fp16 d)

    @staticmethod
    def concatenated(parts: list[Q8Blocks]) -> Q8Blocks:
        """The blocks of one layer whose rows are `parts`' rows, one after the other."""
        return Q8Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]))

    @staticmethod
    def rounded(weight: torch.Tensor) -> Q8Blocks:
        """llama.cpp's Q8_0 of a float weight [N, K] (K a multiple of 32), by the gguf package's own quantizer:
        per 32 columns d = max |w| / 127 stored as fp16, q = roundf(w / d)."""
        from gguf import GGMLQuantizationType, quants

        return unpack_q8_blocks(quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q8_0))

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(self.q.astype(np.float32)) * torch.from_numpy(self.scale).repeat_interleave(GROUP, 1)

    def permuted(self, undo) -> Q8Blocks:
        return Q8Blocks(undo(self.q), undo(self.scale))


def _fp16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


Q4_K_WEIGHTS = 256  # weights per Q4_K super-block: 8 sub-blocks of GROUP
_Q4_K_BYTES = 2 + 2 + 12 + Q4_K_WEIGHTS // 2  # d, dmin (fp16 each), packed 6-bit scales and mins, nibbles: 144


def unpack_q4_k_blocks(raw: np.ndarray) -> Q4Blocks:
    """A GGUF Q4_K tensor's bytes ([N, K/256 * 144] uint8) as Q4Blocks, exactly: per 32-weight sub-block j of a
    super-block, w = (d sc_j) q - dmin m_j, i.e. scale = d sc_j and zero = 8 scale - dmin m_j (fp32).

    Super-block layout (ggml): d (fp16), dmin (fp16), 12 bytes of 6-bit scales sc and mins m for the 8
    sub-blocks, 128 bytes of nibbles. Bytes 0-3 hold sc 0-3 in their low 6 bits, bytes 4-7 m 0-3; bytes 8-11
    hold the low 4 bits of sc 4-7 (low nibble) and of m 4-7 (high nibble), whose top 2 bits are the top 2 bits
    of bytes 0-3 (sc) and 4-7 (m). Nibble byte 32 c + i holds weight i of sub-block 2c (low nibble) and of
    sub-block 2c + 1 (high nibble)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _Q4_K_BYTES)
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    low, high, mixed = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, GROUP)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3).reshape(rows, -1)  # sub-blocks 2c, 2c + 1
    scale = (d[..., None] * sc).reshape(rows, -1)
    minimum = (dmin[..., None] * m).reshape(rows, -1)
    return Q4Blocks(q, scale, 8 * scale - minimum)


def unpack_q4_blocks(raw: np.ndarray, type_name: str) -> Q4Blocks:
    """A GGUF Q4_0 / Q4_1 / Q4_K tensor's bytes ([N, K/32 * block bytes] uint8; Q4_K: unpack_q4_k_blocks) as
    Q4Blocks.

    Block layout (ggml): Q4_1 = d (fp16), m (fp16), 16 bytes of nibbles; Q4_0 = d (fp16), 16 bytes.
    Byte j holds element j in its low nibble and element j + 16 in its high nibble."""
    if type_name == "Q4_K":
        return unpack_q4_k_blocks(raw)
    head = 4 if type_name == "Q4_1" else 2
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, head + GROUP // 2)
    d = _fp16_field(blocks, 0)
    nibbles = blocks[..., head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    if type_name == "Q4_1":
        return Q4Blocks(q, d, _fp16_field(blocks, 2) + 8 * d)
    return Q4Blocks(q, d, np.zeros_like(d))


def unpack_q8_blocks(raw: np.ndarray, type_name: str = "Q8_0") -> Q8Blocks:
    """A GGUF Q8_0 tensor's bytes ([N, K/32 * 34] uint8: d (fp16), then 32 int8) as Q8Blocks; a Q5_0 tensor's
    (unpack_q5_0_blocks) too."""
    if type_name == "Q5_0":
        return unpack_q5_0_blocks(raw)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + GROUP)
    return Q8Blocks(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1), _fp16_field(blocks, 0))


def unpack_q5_0_blocks(raw: np.ndarray) -> Q8Blocks:
    """A GGUF Q5_0 tensor's bytes ([N, K/32 * 22] uint8) as Q8Blocks, exactly: w = d (q - 16) with q in 0..31, so
    the int8 q - 16 (in -16..15) with scale d. llama-quantize falls back to Q5_0 for Q4_K layers whose width is
    not a multiple of 256 (all of SmolLM2-135M's 576-wide ones in a Q4_K_M file).

    Block layout (ggml): d (fp16), 4 bytes qh (bit j: the fifth bit of weight j), 16 bytes of nibbles (byte j:
    weight j in the low nibble, weight j + 16 in the high one)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + 4 + GROUP // 2)
    high_bits = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [rows, blocks, 1]
    fifth = ((high_bits >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    nibbles = blocks[..., 6:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | (fifth << 4)
    return Q8Blocks((q.astype(np.int16) - 16).astype(np.int8).reshape(rows, -1), _fp16_field(blocks, 0))


class FewRowsLinear(nn.Module):
    """What Q4Linear, Q8Linear and block_linears.BlockLinear share: a few rows on their kernel (`_few_rows`), more
    on `dense`."""

    weight = None  # as Fp16Linear's: no dense weight to read

    def _setup(self, shape: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype,
               dense: nn.Module | None) -> None:
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self.dense = dense
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each call skipped where it would be a no-op: 120 of these a SmolLM2 step, ~1 µs a call at one row
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if self.dense is not None and flat.shape[0] > self.max_rows:
            out = self.dense(flat)
        else:
            out = self._few_rows(flat)
            bias = self._parameters.get("bias")  # the dict, not nn.Module.__getattr__
            if bias is not None:
                out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _held_bytes(self) -> int:
        """Bytes its few-row kernel's weights take. They are not buffers: kernels/layers/surgery.py's
        own_remaining_tensors gives every buffer new storage, which would leave the kernel's as a second copy."""
        return 0

    def stored_bytes(self) -> int:
        dense = 0 if self.dense is None else self.in_features * self.out_features * 2  # its packed bf16 copy
        buffers = sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())
        return buffers + self._held_bytes() + dense

    def _describe(self, weights: str) -> str:
        activations = str(self.dtype).removeprefix("torch.")
        dense = f", above {self.max_rows} rows bf16 oneDNN" if self.dense is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights={weights} group {GROUP}, "
                f"activations={activations}{dense}")


def fp16_fits(blocks: Q4Blocks) -> bool:
    """Whether the Q4 kernel's fp16 scale and minimum (zero - 8 scale) hold these blocks' finite: always for
    Q4_0 / Q4_1 (the GGUF's own fp16, exact); Q4_K's d sc_j and dmin m_j round to fp16 (half an fp16 ulp: 2^-11
    relative where normal, below the bf16 activations' 2^-8) and could overflow it."""
    with np.errstate(over="ignore"):
        return all(np.isfinite(values.astype(np.float16)).all()
                   for values in (blocks.scale, blocks.zero - 8 * blocks.scale))


# the op's overload itself: calling the packet resolves it on every call (~1 µs; 120 calls a SmolLM2 step)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


class Q4Linear(FewRowsLinear):
    """`nn.Linear` on 4-bit weights with activations in `dtype` (fp32 or bf16): bf16 on kernels/cpu/q4_kernel.py
    where it runs (`kernel_weights`), else on torch's x86 int4 kernel (group 32); with `dense`, more than
    Q4_MAX_ROWS rows there (SmolLM2's layer set at 1 / 8 / 32 rows: torch's int4 66 / 180 / 671 µs, bf16 oneDNN
    163 / 200 / 375 µs)."""

    max_rows = Q4_MAX_ROWS

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 dense: nn.Module | None = None):
        super().__init__()
        self._setup(blocks.q.shape, bias, dtype, dense)
        self.kernel_weights = None
        if dtype == torch.bfloat16 and fp16_fits(blocks) and q4_kernel.kernel() is not None:
            self.kernel_weights = q4_kernel.pack(blocks.q, blocks.scale, blocks.zero)
            return
        q = torch.from_numpy(blocks.q.astype(np.int32))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        scale_zero = np.stack([blocks.scale.T, blocks.zero.T], axis=-1)  # [K/32, N, 2]
        self.register_buffer("scale_zero", torch.from_numpy(np.ascontiguousarray(scale_zero)).to(dtype))

    def _held_bytes(self) -> int:
        return 0 if self.kernel_weights is None else self.kernel_weights.packed.nbytes

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel_weights is not None:
            return self.kernel_weights(flat)
        buffers = self._buffers  # the dict, not nn.Module.__getattr__ (2 lookups a call)
        return _INT4_MM(flat, buffers["packed"], GROUP, buffers["scale_zero"])

    def extra_repr(self) -> str:
        if self.kernel_weights is not None:
            return self._describe("int4") + ", fp16 scales on the AVX-512 BF16 kernel"
        return self._describe("int4")


class ReorderedQ4Linear(Q4Linear):
    """A Q4Linear whose blocks hold the input columns in another order (`Q4Blocks.columns`): the input is
    gathered into that order first (one index_select of the rows, ~1 µs a call at one row). Its own class:
    the layer chains (kernels/layers/chains.py) take plain Q4Linear layers only, whose input is the row as
    it is."""

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 dense: nn.Module | None = None):
        super().__init__(blocks, bias, dtype, dense)
        self.register_buffer("columns", torch.from_numpy(np.ascontiguousarray(blocks.columns)))

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        return super()._few_rows(flat.index_select(1, self._buffers["columns"]))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", input columns reordered (activation order)"


def q4_linear(blocks: Q4Blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
              dense: nn.Module | None = None) -> Q4Linear:
    """The Q4 layer for `blocks`: a ReorderedQ4Linear where they hold the columns in another order."""
    layer = Q4Linear if blocks.columns is None else ReorderedQ4Linear
    return layer(blocks, bias, dtype, dense)


def q8_fits(in_features: int, dtype: torch.dtype) -> bool:
    """Whether a Q8_0 layer this wide, computing in `dtype`, can run on this CPU (the VNNI kernel)."""
    return dtype == torch.bfloat16 and in_features % GROUP == 0 and vnni_matmul.kernel() is not None


class Q8Linear(FewRowsLinear):
    """`nn.Linear` on a GGUF's Q8_0 blocks with bf16 activations: up to Q8_MAX_ROWS rows on the VNNI kernel
    (int16 activations), more on `dense`. Only where `q8_fits`."""

    max_rows = Q8_MAX_ROWS

    def __init__(self, blocks: Q8Blocks, bias: torch.Tensor | None, dense: nn.Module | None = None):
        super().__init__()
        self._setup(blocks.q.shape, bias, torch.bfloat16, dense)
        if not q8_fits(self.in_features, torch.bfloat16):
            raise ValueError(f"a Q8_0 layer needs the VNNI kernel: in_features a multiple of {GROUP} and a CPU "
                             "with AVX-512 VNNI")
        self.vnni_weights = vnni_matmul.pack(blocks.q, blocks.scale)  # (q, d): read by the kernel

    def _held_bytes(self) -> int:
        return sum(array.nbytes for array in self.vnni_weights)

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        return vnni_matmul.matmul(flat, *self.vnni_weights)

    def extra_repr(self) -> str:
        return self._describe("int8") + ", int16 activations on VNNI"
