"""Model surgery's one primitive, shared by every swap (quantize, linear kernels, stacking, norms, LoRA)."""

from __future__ import annotations

from torch import nn


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` (dotted, as named_modules gives it) of `model` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
