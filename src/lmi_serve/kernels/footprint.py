"""What a planned model's weights take in memory, by form: the bytes GET /models/<m> shows and the
multi-model memory budget counts once a model has loaded (serving/memory_budget.py estimates before).

    weights      the model's parameters and buffers as the plan left them: for a layer the plan swapped,
                 the form its kernel reads instead of the loaded weight (oneDNN's packed weight, fp16 packs,
                 Q4/Q8 blocks: each such layer's `stored_bytes()`), which replaces the weight it was made from
    row_copies   the row kernel's second copy of fp32 Linear weights (cpu/row_kernel.py), held beside oneDNN's:
                 oneDNN computes prefill and wide batches, the copy 1-64 rows with oneDNN's bits, so neither
                 can stand for the other (option.row_kernel=off drops it)

Tensors shared by several modules (tied embeddings) count once. Read from tensor sizes only, once at load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class WeightFootprint:
    weights: int
    row_copies: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.row_copies

    def describe(self) -> dict[str, int]:
        return {"weightsBytes": self.weights, "rowKernelCopiesBytes": self.row_copies}


def weight_footprint(model: nn.Module, row_copies: int = 0) -> WeightFootprint:
    """`model`'s weights in the forms it holds them (module docstring) and `row_copies`, the row kernel's bytes
    (RowKernelReport.nbytes)."""
    seen: set[int] = set()
    total = 0
    for module in _outermost_stored(model):
        if hasattr(module, "stored_bytes"):
            total += module.stored_bytes()
            continue
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            total += _once(tensor, seen)
    return WeightFootprint(total, row_copies)


def _outermost_stored(model: nn.Module) -> Iterator[nn.Module]:
    """Every module, except those inside a module that reports its own `stored_bytes()` (its `dense` fallback
    is in that figure)."""
    stack, visited = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in visited:  # a stacked layer is a submodule of each sibling it serves (shared_input.py)
            continue
        visited.add(id(module))
        yield module
        if not hasattr(module, "stored_bytes"):
            stack.extend(child for child in module._modules.values() if child is not None)


def _once(tensor: Any, seen: set[int]) -> int:
    if not isinstance(tensor, torch.Tensor):
        return 0
    try:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # an opaque tensor (mkldnn): its elements
        key, size = id(tensor), tensor.numel() * tensor.element_size()
    if key in seen:
        return 0
    seen.add(key)
    return size
