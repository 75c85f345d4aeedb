"""Model surgery's primitives, shared by every swap (quantize, linear kernels, stacking, norms, LoRA): put a
module in another's place, and give back the memory a swap freed."""

from __future__ import annotations

import ctypes
import gc

import psutil
import torch
from torch import nn


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` (dotted, as named_modules gives it) of `model` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def process_rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def return_freed_memory() -> None:
    """Give the swap's freed temporaries back to the OS (glibc keeps them otherwise: ~290 MiB for q4)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def own_remaining_tensors(model: nn.Module) -> None:
    """Copy what the swap left (embeddings, norms, biases) out of the loaded file: tensors loaded
    from safetensors are views of one memory-mapped file, which stays mapped (and resident) while
    any of them lives, so without this the swapped-out fp32 weights would still count."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def plain_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The plain nn.Linear modules: a subclass has its own forward (Llama 4's router returns a tuple)."""
    return [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
