"""`option.quantize=fp16`'s layer: Linear weights stored in fp16, arithmetic in fp32 (fbgemm's
``linear_prepack_fp16`` / ``linear_dynamic_fp16``). The output equals fp32 ``F.linear`` with the weights
rounded to fp16. kernels/layers/quantize.py swaps it in."""

from __future__ import annotations

import torch
from torch import nn


class Fp16Linear(nn.Module):
    """`nn.Linear` with fp16-stored weights and fp32 compute (fbgemm). Holds no fp32 weight."""

    weight = None  # none to read: models that cast to `layer.weight.dtype` when it is a Tensor (T5) skip that

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    def stored_bytes(self) -> int:
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=fp16"
