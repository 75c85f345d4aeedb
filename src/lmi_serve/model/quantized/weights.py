"""The neutral integer weight every pre-quantized format unpacks into, and its dequantizer.

`IntWeight` holds a Linear layer's weight as unsigned integer codes, [out, in] like `nn.Linear.weight`,
and per-group float32 scales and zero points [out, groups]; `g_idx[i]` is the group of input column i
(column i // group_size unless GPTQ's desc_act reordered the columns). The weight it stands for is

    w[o, i] = (codes[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]]

computed in float32. With codes of at most 8 bits and fp16 or bf16 scales every product is exact in
float32 (an 8-bit integer times an 11-bit mantissa), so `dequantize` gives the value each format's own
reference computes before it rounds to its activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IntWeight:
    """A Linear weight as `bits`-bit unsigned codes with per-group scales and zero points."""

    bits: int  # 4 (AWQ, GPTQ, compressed-tensors W4A16) or 8 (GPTQ 8-bit, compressed-tensors int8)
    codes: torch.Tensor  # uint8 [out, in], each in [0, 2**bits)
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # float32 [out, groups]: the code that stands for 0.0 (an integer value)
    g_idx: torch.Tensor  # int64 [in]: the group of each input column

    def __post_init__(self) -> None:
        out, width = self.codes.shape
        if self.codes.dtype != torch.uint8 or self.scales.shape != self.zeros.shape or self.scales.shape[0] != out:
            raise ValueError(f"IntWeight: codes {tuple(self.codes.shape)} {self.codes.dtype}, scales "
                             f"{tuple(self.scales.shape)}, zeros {tuple(self.zeros.shape)} do not fit together")
        if self.g_idx.shape != (width,):
            raise ValueError(f"IntWeight: g_idx has shape {tuple(self.g_idx.shape)}, expected ({width},)")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group_size(self) -> int | None:
        """Input columns per group when groups are consecutive runs (no desc_act reordering); else None."""
        width, groups = self.codes.shape[1], self.scales.shape[1]
        if width % groups:
            return None
        size = width // groups
        ordered = torch.arange(width, dtype=torch.int64) // size
        return size if torch.equal(self.g_idx, ordered) else None


def dequantize(weight: IntWeight) -> torch.Tensor:
    """The float32 [out, in] weight `weight` stands for (module docstring)."""
    scales = weight.scales[:, weight.g_idx]
    zeros = weight.zeros[:, weight.g_idx]
    return (weight.codes.to(torch.float32) - zeros) * scales


def consecutive_groups(width: int, group_size: int) -> torch.Tensor:
    """g_idx of `width` columns in consecutive groups of `group_size` (-1 or 0: one group, per channel)."""
    size = width if group_size <= 0 else group_size
    if width % size:
        raise ValueError(f"{width} input columns are not a multiple of group_size {group_size}")
    return torch.arange(width, dtype=torch.int64) // size


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Split each int32 of `packed` into its 32 // bits codes (lowest bits first) along `dim`, as uint8.

    `order[k]` is which of an int32's codes (by bit position) is its k-th element; None: bit order.
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word], bit order
    if order is not None:
        codes = codes[..., list(order)]
    codes = codes.to(torch.uint8)
    if dim in (0, -packed.dim()):
        # [words, cols, per_word] -> [words, per_word, cols] -> [words * per_word, cols]
        return codes.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32`: `codes` (integers in [0, 2**bits)) packed into int32 along `dim`."""
    per_word = 32 // bits
    values = codes.to(torch.int64)
    if dim in (0, -codes.dim()):
        values = values.t()
    rows, cols = values.shape
    if cols % per_word:
        raise ValueError(f"{cols} codes do not fill whole int32 words of {per_word}")
    values = values.reshape(rows, cols // per_word, per_word)
    if order is not None:
        values = values[..., [list(order).index(k) for k in range(per_word)]]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (values << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim in (0, -codes.dim()) else words


def quantize_int(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool,
                 g_idx: torch.Tensor | None = None) -> IntWeight:
    """Round-to-nearest `bits`-bit quantization of a float [out, in] weight in groups (g_idx, else consecutive
    runs of group_size; -1: per channel), scales rounded to fp16 as AWQ and GPTQ store them. Min-max, no
    calibration: what tests and fixtures pack, not a replacement for AWQ's or GPTQ's search. Each
    dequantized value lies within half a scale of the weight."""
    weight = weight.to(torch.float32)
    out, width = weight.shape
    g_idx = consecutive_groups(width, group_size) if g_idx is None else g_idx.to(torch.int64)
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    index = g_idx.expand(out, width)
    lows = torch.zeros(out, groups).scatter_reduce_(1, index, weight, "amin", include_self=False)
    highs = torch.zeros(out, groups).scatter_reduce_(1, index, weight, "amax", include_self=False)
    lows, highs = lows.clamp(max=0), highs.clamp(min=0)  # 0.0 stays representable
    if symmetric:
        scales = (torch.maximum(-lows, highs) * 2 / top).to(torch.float16).to(torch.float32)
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
    else:
        scales = ((highs - lows) / top).to(torch.float16).to(torch.float32)
        zeros = torch.round(-lows / scales.clamp(min=1e-8)).clamp(0, top)
    scales = scales.clamp(min=2.0**-14)  # an all-zero group: any positive scale
    codes = torch.round(weight / scales[:, g_idx] + zeros[:, g_idx]).clamp(0, top).to(torch.uint8)
    return IntWeight(bits=bits, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx)
