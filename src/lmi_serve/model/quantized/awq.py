"""AWQ checkpoints in the GEMM layout (AutoAWQ's `version: "gemm"`, what `transformers` and vLLM read).

A quantized Linear of `in` inputs and `out` outputs is stored as three tensors:

- `qweight` int32 [in, out / 8]: the codes of input row i, eight output columns to an int32, in AWQ's
  interleaved order: the int32's nibbles, lowest first, hold columns 0, 2, 4, 6, 1, 3, 5, 7 of its eight.
- `qzeros` int32 [in / group, out / 8]: each group's zero point (a 4-bit code, no offset), packed as qweight.
- `scales` fp16 [in / group, out].

w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]. AWQ has no activation reordering.
"""

from __future__ import annotations

import torch

from lmi_serve.model.quantized.weights import IntWeight, consecutive_groups, pack_int32, unpack_int32

# the column an int32's k-th nibble (bit order) holds is AWQ_PACK_ORDER[k]; the nibble of column k is AWQ_ORDER[k]
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_ORDER = tuple(AWQ_PACK_ORDER.index(k) for k in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
BITS = 4


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> IntWeight:
    """The layer's `IntWeight` from its AWQ GEMM tensors (module docstring)."""
    codes = unpack_int32(qweight, BITS, dim=1, order=AWQ_ORDER)  # [in, out]
    zeros = unpack_int32(qzeros, BITS, dim=1, order=AWQ_ORDER)  # [groups, out]
    width, out = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != out or zeros.shape != (groups, out) or width % groups:
        raise ValueError(f"AWQ tensors do not fit: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    return IntWeight(bits=BITS, codes=codes.t().contiguous(), scales=scales.t().to(torch.float32).contiguous(),
                     zeros=zeros.t().to(torch.float32).contiguous(),
                     g_idx=consecutive_groups(width, width // groups))


def pack_awq(weight: IntWeight) -> dict[str, torch.Tensor]:
    """`weight` as AWQ GEMM tensors (qweight, qzeros, scales in fp16): the inverse of `unpack_awq`, for tests
    and fixtures. The weight must have consecutive groups and integer zero points."""
    if weight.bits != BITS or weight.group_size is None:
        raise ValueError("AWQ packs 4-bit codes in consecutive groups only")
    return {"qweight": pack_int32(weight.codes.t(), BITS, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(weight.zeros.t().to(torch.uint8), BITS, dim=1, order=AWQ_ORDER),
            "scales": weight.scales.t().to(torch.float16).contiguous()}
