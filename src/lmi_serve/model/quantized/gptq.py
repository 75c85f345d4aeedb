"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), in `checkpoint_format` gptq (v1) or gptq_v2.

A quantized Linear of `in` inputs and `out` outputs is stored as:

- `qweight` int32 [in * bits / 32, out]: the codes of one output column, 32 / bits input rows to an int32,
  lowest bits first (input row 8j + k of a 4-bit layer is nibble k of row j).
- `qzeros` int32 [groups, out * bits / 32]: each group's zero point, 32 / bits output columns to an int32.
- `scales` fp16 [groups, out].
- `g_idx` int32 [in]: the group of each input row. With `desc_act` (activation order) the rows were
  quantized in another order, so g_idx is not i // group_size; without it, it is (and may be absent).

w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]. In v1 checkpoints z is the stored code plus one,
modulo 2**bits: AutoGPTQ stored `zero - 1` and its torch dequantizer adds the one back and masks (a
symmetric 4-bit layer's zero 8 is stored as 7, `0x77777777`; a stored 15 reads as zero 0, where some CUDA
kernels read 16). `gptq_v2` (GPTQModel's internal format) stores z itself.
"""

from __future__ import annotations

import torch

from lmi_serve.model.quantized.weights import IntWeight, consecutive_groups, pack_int32, unpack_int32

FORMATS = ("gptq", "gptq_v2")
SUPPORTED_BITS = (4, 8)  # 2-bit packs too, but no kernel of ours takes it; 3-bit straddles int32s


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                *, bits: int, group_size: int, checkpoint_format: str = "gptq") -> IntWeight:
    """The layer's `IntWeight` from its GPTQ tensors (module docstring)."""
    if bits not in SUPPORTED_BITS or checkpoint_format not in FORMATS:
        raise ValueError(f"GPTQ {bits}-bit {checkpoint_format!r} is not read here (bits {SUPPORTED_BITS}, "
                         f"formats {FORMATS})")
    codes = unpack_int32(qweight, bits, dim=0)  # [in, out]
    zeros = unpack_int32(qzeros, bits, dim=1).to(torch.float32)  # [groups, out]
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) % (1 << bits)  # v1 stores zero - 1 (module docstring)
    width, out = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != out or zeros.shape != (groups, out):
        raise ValueError(f"GPTQ tensors do not fit: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    if g_idx is None:
        g_idx = consecutive_groups(width, group_size if group_size > 0 else width)
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (width,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"GPTQ g_idx of shape {tuple(g_idx.shape)} does not index {groups} groups of {width} rows")
    return IntWeight(bits=bits, codes=codes.t().contiguous(), scales=scales.t().to(torch.float32).contiguous(),
                     zeros=zeros.t().contiguous(), g_idx=g_idx)


def pack_gptq(weight: IntWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """`weight` as GPTQ tensors (qweight, qzeros, scales in fp16, g_idx int32): the inverse of `unpack_gptq`,
    for tests and fixtures. v1 stores zero - 1 modulo 2**bits."""
    zeros = weight.zeros.t().to(torch.int64)
    if checkpoint_format == "gptq":
        zeros = (zeros - 1) & ((1 << weight.bits) - 1)
    return {"qweight": pack_int32(weight.codes.t(), weight.bits, dim=0),
            "qzeros": pack_int32(zeros, weight.bits, dim=1),
            "scales": weight.scales.t().to(torch.float16).contiguous(),
            "g_idx": weight.g_idx.to(torch.int32)}
