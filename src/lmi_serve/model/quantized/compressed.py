"""compressed-tensors checkpoints (llm-compressor's output; `quant_method: compressed-tensors`).

Each quantized Linear `m` keeps its tensors under `m.`:

- `pack-quantized` (W4A16, W8A16): `weight_packed` int32 [out, ceil(in * bits / 32)], the signed codes plus
  2**(bits-1) packed densely along the input dimension, lowest bits first (eight 4-bit codes to an int32);
  `weight_shape` [out, in]; `weight_scale` [out, groups] (group), [out, 1] (channel) or one value (tensor);
  for asymmetric schemes `weight_zero_point`, signed, packed the same way but along the output dimension
  ([ceil(out * bits / 32), groups]); `weight_g_idx` [in] where an older activation-ordered scheme wrote one.
- `int-quantized` / `naive-quantized` (W8A8, W8A16): `weight` int8 [out, in] and `weight_scale` (and an
  int8 `weight_zero_point` when asymmetric); W8A8's activations are quantized at run time (dynamic, per
  token) or with an `input_scale` (static).
- `float-quantized` (FP8): `weight` float8_e4m3fn [out, in] and `weight_scale`: one value, [out, 1] or
  [ceil(out / b0), ceil(in / b1)] for `block_structure` [b0, b1].

w = (q - zero_point) * scale in every integer scheme, with zero_point 0 when symmetric; FP8's w = q * scale.
"""

from __future__ import annotations

import math

import torch

from lmi_serve.model.quantized.weights import IntWeight, consecutive_groups, unpack_int32

SUPPORTED_BITS = (4, 8)


def scales_per_group(scale: torch.Tensor, out: int) -> torch.Tensor:
    """`weight_scale` (or a zero point) of any integer strategy as float32 [out, groups]: one value (tensor)
    is one group for every row, [out, 1] is one group (channel), [out, groups] stays."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out, 1).contiguous()
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    if scale.shape[0] != out:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit a weight of {out} rows")
    return scale.contiguous()


def unpack_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor, *,
                          bits: int, weight_zero_point: torch.Tensor | None = None,
                          weight_g_idx: torch.Tensor | None = None) -> IntWeight:
    """A `pack-quantized` layer's `IntWeight` (module docstring). Its codes are the signed codes plus
    2**(bits-1), so a symmetric layer's zero point is 2**(bits-1)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack-quantized {bits}-bit weights are not read here (bits {SUPPORTED_BITS})")
    out, width = (int(v) for v in weight_shape.tolist())
    codes = unpack_int32(weight_packed, bits, dim=1)[:, :width]
    scales = scales_per_group(weight_scale, out)
    offset = 1 << (bits - 1)
    if weight_zero_point is None:
        zeros = torch.full_like(scales, float(offset))
    elif weight_zero_point.dtype == torch.int32:  # packed along the output dimension
        zeros = unpack_int32(weight_zero_point, bits, dim=0)[:out].to(torch.float32)
    else:  # an unpacked signed zero point (older writers)
        zeros = scales_per_group(weight_zero_point, out) + offset
    if codes.shape != (out, width) or zeros.shape != scales.shape:
        raise ValueError(f"pack-quantized tensors do not fit: weight_packed {tuple(weight_packed.shape)}, "
                         f"weight_shape {(out, width)}, weight_scale {tuple(weight_scale.shape)}")
    groups = scales.shape[1]
    g_idx = (weight_g_idx.to(torch.int64) if weight_g_idx is not None
             else consecutive_groups(width, width // groups if width % groups == 0 else -1))
    return IntWeight(bits=bits, codes=codes.contiguous(), scales=scales, zeros=zeros, g_idx=g_idx)


def int8_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None = None,
                weight_g_idx: torch.Tensor | None = None) -> IntWeight:
    """An `int-quantized` / `naive-quantized` int8 layer's `IntWeight`: codes are the int8 values plus 128,
    zero points 128 plus the stored one (losslessly: codes - 128 gives the int8 weight back)."""
    if weight.dtype != torch.int8:
        raise ValueError(f"an int-quantized weight must be int8, got {weight.dtype}")
    out, width = weight.shape
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = scales_per_group(weight_scale, out)
    zeros = (scales_per_group(weight_zero_point, out) if weight_zero_point is not None
             else torch.zeros_like(scales)) + 128
    groups = scales.shape[1]
    g_idx = (weight_g_idx.to(torch.int64) if weight_g_idx is not None
             else consecutive_groups(width, width // groups if width % groups == 0 else -1))
    return IntWeight(bits=8, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   block_structure: tuple[int, int] | None = None) -> torch.Tensor:
    """A `float-quantized` FP8 layer's float32 [out, in] weight: per tensor, per channel, per group or per
    block scales (module docstring)."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"a float-quantized weight must be float8, got {weight.dtype}")
    values = weight.to(torch.float32)
    scale = weight_scale.to(torch.float32)
    out, width = values.shape
    if block_structure is not None and scale.numel() > 1:
        rows, cols = block_structure
        if scale.shape != (math.ceil(out / rows), math.ceil(width / cols)):
            raise ValueError(f"block scale {tuple(scale.shape)} does not fit {out}x{width} in {rows}x{cols} blocks")
        full = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :width]
        return values * full
    scales = scales_per_group(scale, out)
    return values * scales[:, consecutive_groups(width, width // scales.shape[1])]
