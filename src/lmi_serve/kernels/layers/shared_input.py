"""Sibling Linear layers that read the same input, computed as one matmul (model surgery, no engine).

A decoder layer multiplies one hidden state by q, k and v (and, in its MLP, by gate and up): three (two)
matmuls that each read the activations and start oneDNN's threads again. Stacked into one weight, they are
one call: on SmolLM2's shapes (2 threads, AVX-512 Xeon) q/k/v took 84 µs a layer instead of 161 at one row
and 255 instead of 343 at 32 rows, gate/up 0.88-1.0x; the whole one-row step ~5 % (benchmarks/journal/2026-11.md).
Each output column is the same dot product as before, and oneDNN sums it in the same order whatever the
number of columns: the stacked layer's slices equal the separate layers' outputs bit for bit (the tests
check it), so batch invariance and every greedy reference hold unchanged. option.quantize=q4's int4 layers
stack the same way (kernels/layers/quantize.py: torch's int4 kernel computes each output element on its own).

The model's own forward still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`: each becomes a `SharedInputSlice`
of one `SharedInputGroup`. The first member called computes all of them for `x` and keeps the result; the
others take their slice when they are called with that same tensor, unchanged since (as far as torch
counts changes: not under inference_mode). Anything else (another
input, a member asking twice) computes again, so a model that feeds siblings different inputs (a
cross-attention's q and k) gets right answers, only the wasted columns; encoder-decoder models and modules
named as cross-attention are not grouped for that reason. The kept result is per thread (a handler may run
forwards from several) and dropped once every member has its slice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmi_serve.kernels.layers.surgery import replace_module

# Children of one module that read the same input in the architectures transformers ships: attention's
# q/k/v (Llama, Mistral, Qwen, Gemma, ... and BERT's query/key/value) and the gated MLP's gate/up.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("gate_proj", "up_proj"))


class SharedInputGroup:
    """One stacked layer for several layers of one input, and the last result, per thread."""

    def __init__(self, stacked: nn.Module, members: int):
        self.linear = stacked
        self.members = members
        self._kept = threading.local()

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """The stacked output for `x`: the kept one while it is for this very tensor (same object, not
        modified in place since) and `member` has not taken it yet; else computed again."""
        kept: _Kept | None = getattr(self._kept, "value", None)
        version = _version(x)
        if kept is None or kept.input is not x or kept.version != version or member in kept.taken:
            kept = _Kept(x, version, self.linear(x), set())
            self._kept.value = kept
        kept.taken.add(member)
        if len(kept.taken) == self.members:  # every member has its slice: hold nothing between forwards
            self._kept.value = None
        return kept.output


def _version(x: torch.Tensor) -> int | None:
    """torch's count of in-place changes to `x`; None for a tensor made under inference_mode, which keeps
    no count (no architecture in transformers changes the hidden state between q, k and v, or gate and up)."""
    return None if x.is_inference() else x._version


@dataclass
class _Kept:
    input: torch.Tensor
    version: int | None
    output: torch.Tensor
    taken: set[int]


class SharedInputSlice(nn.Module):
    """One layer of a SharedInputGroup: the columns [start, stop) of the stacked output, as its own tensor."""

    weight = None  # as OneDnnLinear / Q4Linear: the packed weight is opaque

    def __init__(self, group: SharedInputGroup, member: int, start: int, stop: int):
        super().__init__()
        self._group, self._member, self._start, self._stop = group, member, start, stop
        self.in_features, self.out_features = group.linear.in_features, stop - start
        self.dtype = group.linear.dtype
        # The stacked layer is registered once, on the group's first member, so state_dict and .to() see it once.
        if member == 0:
            self.stacked = group.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Contiguous: a model may .view() its projection as it would a plain Linear's output.
        return self._group.output(self._member, x)[..., self._start:self._stop].contiguous()

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"in_features={self.in_features}, out_features={self.out_features}, columns {self._start}:"
                f"{self._stop} of a stacked {type(self._group.linear).__name__}, {dtype}")


def _groups(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(parent module name, its sibling children's names) for every group that can be stacked."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return []
    found = []
    for parent_name, parent in model.named_modules():
        if "cross" in parent_name.rsplit(".", 1)[-1].lower():
            continue
        for names in SIBLINGS:
            layers = [getattr(parent, name, None) for name in names]
            if not all(type(layer) is nn.Linear for layer in layers):
                continue
            first = layers[0]
            if all(layer.in_features == first.in_features and layer.weight.dtype == first.weight.dtype
                   and layer.weight.device == first.weight.device and (layer.bias is None) == (first.bias is None)
                   for layer in layers):
                found.append((parent_name, names))
    return found


def stack_groups(model: nn.Module, build: Callable[[list[str], list[nn.Linear]], nn.Module | None]) -> list[str]:
    """Replace each group of sibling nn.Linear layers (SIBLINGS) in `model` for which `build(full names,
    layers)` returns a stacked layer (their outputs' columns one after the other, in that order) by
    SharedInputSlices of it; returns the replaced layers' names."""
    replaced = []
    with torch.no_grad():
        for parent_name, names in _groups(model):
            parent = model.get_submodule(parent_name) if parent_name else model
            layers = [getattr(parent, name) for name in names]
            full_names = [f"{parent_name}.{name}" if parent_name else name for name in names]
            stacked = build(full_names, layers)
            if stacked is None:
                continue
            group = SharedInputGroup(stacked, len(layers))
            start = 0
            for member, (full, layer) in enumerate(zip(full_names, layers)):
                replace_module(model, full, SharedInputSlice(group, member, start, start + layer.out_features))
                start += layer.out_features
                replaced.append(full)
    return replaced


def stack_shared_inputs(model: nn.Module, packable: tuple[torch.dtype, ...],
                        pack: Callable[[nn.Linear], nn.Module]) -> list[str]:
    """Replace each group of sibling nn.Linear layers (SIBLINGS) in `model` whose weights are packable on this
    CPU by SharedInputSlices of one stacked layer made by `pack` (OneDnnLinear); returns the replaced layers'
    names. Runs before the layer-by-layer swap (linear_kernels.use_linear_kernel), which packs what is left."""
    def build(_names: list[str], layers: list[nn.Linear]) -> nn.Module | None:
        if layers[0].weight.dtype not in packable or layers[0].weight.device.type != "cpu":
            return None
        return pack(concatenated_linear(layers))

    return stack_groups(model, build)


def concatenated_linear(layers: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the layers' outputs side by side."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    # Made on the meta device and given the stacked tensors: no random initialisation to overwrite (~0.4 s a
    # SmolLM2 start) and no second copy.
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=layers[0].bias is not None, dtype=weight.dtype,
                        device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
    return stacked
