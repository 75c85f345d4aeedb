"""Which attention a model's decode steps run: kernels/cpu/decode_kernel.py's kernel or SDPA (option.decode_attention).

The choice is a flag on the model's config (and its text config, for a vision-language model), set by the plan
(kernels/plan.py `decode_attention` step, `use_decode_kernel`); the KV layouts (engine/kv/slot_attention.py,
engine/kv/slots.py) ask `decode_kernel_applies(module)` at each decode step and call the kernel where it
also takes the tensors (`decode_kernel.eligible`).
"""

from __future__ import annotations

from typing import Any

import torch

from lmi_serve.kernels.cpu import decode_kernel

# On a model's config (absent: True); False keeps its decode steps on SDPA.
KERNEL_FLAG = "_lmi_decode_kernel"


def attention_configs(model: Any) -> list[Any]:
    """The configs whose attention settings a model's layers read: its own and its text model's."""
    config = model.config
    return [config, *(c for c in (getattr(config, "text_config", None),) if c is not None and c is not config)]


def decode_kernel_applies(module: torch.nn.Module) -> bool:
    """Whether `module`'s model lets its decode steps attend in the decode kernel (option.decode_attention)."""
    return getattr(getattr(module, "config", None), KERNEL_FLAG, True)


def use_decode_kernel(model: Any, on: bool) -> bool:
    """Whether `model`'s decode steps may attend with the decode kernel where it applies (option.decode_attention);
    when they may and the model is fp32 or bf16 on the CPU, the kernel is compiled now, not in a request's step.
    True where the kernel will attend (compiled for this model's dtype and device)."""
    for config in attention_configs(model):
        setattr(config, KERNEL_FLAG, on)
    device = getattr(model, "device", None)
    if on and getattr(model, "dtype", None) in decode_kernel.DTYPES and getattr(device, "type", None) == "cpu":
        return decode_kernel.kernel() is not None
    return False
