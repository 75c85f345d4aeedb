"""The layer half of kernels/cpu/layer_chain.py and kernels/cpu/q4_chain.py: a decoder layer's swapped children
(FusedRMSNorm, stacked SharedInputSlice, row-kernel copies or Q4Linear / BlockLinear) read into the arguments of the chain's
three numba calls, and the calls made. lean_layers.py makes one per layer (`LayerChain.of`, `Q4LayerChain.of`);
`takes` says whether a forward's rows go this way (at most the registry's rows for the chain).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from lmi_serve.kernels.cpu import block_matmul, layer_chain, norm_kernel, q4_chain, rotary_kernel, row_kernel
from lmi_serve.kernels.cpu.numba_bits import match_torch_threads
from lmi_serve.kernels.layers.block_linears import BlockLinear
from lmi_serve.kernels.layers.fused_norms import FusedRMSNorm
from lmi_serve.kernels.layers.gguf_linears import Q4Linear
from lmi_serve.kernels.layers.shared_input import SharedInputSlice


def _row_weights(linear: nn.Module) -> row_kernel.RowWeights | None:
    """`linear`'s row-kernel copy where its forward of a few rows is that copy's (an OneDnnLinear:
    row_kernel.copy_of) and the copy is unpadded (width = its outputs)."""
    if linear._forward_hooks or linear._forward_pre_hooks:
        return None
    weights = row_kernel.copy_of(linear)
    return weights if weights is not None and weights.width == weights.out_features else None


def stacked_weights(members: tuple[nn.Module, ...], weights_of: Callable[[nn.Module], Any] = _row_weights) -> Any:
    """`weights_of` the one stacked layer `members` are the slices of, in order (its row-kernel copy by
    default), or None."""
    first = members[0]
    if not all(isinstance(m, SharedInputSlice) and not m._forward_hooks and not m._forward_pre_hooks
               for m in members):
        return None
    group = first._group
    if group.members != len(members) or any(m._group is not group or m._member != i for i, m in enumerate(members)):
        return None
    return weights_of(group.linear)


def stacked_sizes(members: tuple[SharedInputSlice, ...]) -> list[int]:
    """The members' widths where their columns tile the stacked output in order from 0, else []."""
    at = 0
    for member in members:
        if member._start != at:
            return []
        at = member._stop
    return [member._stop - member._start for member in members] if at == members[0]._group.linear.out_features \
        else []


NO_ROTATION = (0, 0, 1, 1, 1, 1, 2)  # attention_in's rotary arguments when it does not rotate


class LayerChain:
    """One decoder layer's three calls (module docstring), made by `LayerChain.of`; each method takes
    contiguous rows [..., width] of `dtype` (at most `max_rows` of them: `takes`). The fp32 kind on the row
    kernel; kernels/cpu/q4_chain.py's Q4LayerChain is the bf16 kind on the Q4 kernel, the class attributes and
    static methods below its own."""

    dtype = torch.float32
    norm_form = "direct"  # the FusedRMSNorm form (fused_norms.py) whose arithmetic its calls run
    max_rows = layer_chain.MAX_ROWS

    @staticmethod
    def calls() -> dict[str, Any] | None:
        """The compiled calls, or None where they do not run here."""
        return layer_chain.kernel()

    @staticmethod
    def weights_of(linear: nn.Module) -> Any | None:
        """`linear`'s weights for the calls where its forward of a few rows is theirs alone, or None."""
        return _row_weights(linear)

    @staticmethod
    def weight_arguments(weights: Any) -> tuple:
        """A layer's weights as the calls take them."""
        return weights._weights_address, weights.tiles, weights.block, weights._bias_address

    @staticmethod
    def _threads() -> tuple:
        """The calls' last arguments, after numba's threads are matched to torch's: none for this kind."""
        match_torch_threads()
        return ()

    def __init__(self, input_norm: FusedRMSNorm, qkv: Any, o: Any, post_norm: FusedRMSNorm, gate_up: Any,
                 down: Any):
        self.width = qkv.in_features
        self.qkv_width, self.gate_up_width = qkv.out_features, gate_up.out_features
        self._input_norm = (input_norm.weight.data_ptr(), np.float32(input_norm.variance_epsilon))
        self._post_norm = (post_norm.weight.data_ptr(), np.float32(post_norm.variance_epsilon))
        self._kept = (input_norm.weight, post_norm.weight, qkv, o, gate_up, down)  # alive with their addresses
        self._qkv, self._o, self._gate_up, self._down = map(self.weight_arguments, (qkv, o, gate_up, down))
        self._o_in, self._down_in = o.in_features, down.in_features
        self.qkv_sizes: list[int] = []  # each member's columns of the stacked outputs, in order (`split`)
        self.gate_up_sizes: list[int] = []
        self.qk_width = 0  # q's and k's columns: the ones rotary turns
        self._lanes = norm_kernel.kernel()["lanes"]
        self._calls = self.calls()

    @classmethod
    def of(cls, input_norm: nn.Module, qkv: tuple[nn.Module, ...], o: nn.Module, post_norm: nn.Module,
           gate_up: tuple[nn.Module, ...], down: nn.Module) -> "LayerChain | None":
        """The chain of a layer with these children, or None where one of them is not on our kernels."""
        if cls.calls() is None:
            return None
        pieces = (cls._norm(input_norm), stacked_weights(qkv, cls.weights_of), cls.weights_of(o),
                  cls._norm(post_norm), stacked_weights(gate_up, cls.weights_of), cls.weights_of(down))
        if any(piece is None for piece in pieces):
            return None
        norm1, qkv_w, o_w, norm2, gate_up_w, down_w = pieces
        width = qkv_w.in_features
        if not (o_w.out_features == gate_up_w.in_features == down_w.out_features == width
                == norm1.weight.shape[0] == norm2.weight.shape[0]):
            return None
        chain = cls(norm1, qkv_w, o_w, norm2, gate_up_w, down_w)
        chain.qkv_sizes, chain.gate_up_sizes = stacked_sizes(qkv), stacked_sizes(gate_up)
        chain.qk_width = sum(chain.qkv_sizes[:2])
        return chain if chain.qkv_sizes and chain.gate_up_sizes else None

    @classmethod
    def _norm(cls, norm: nn.Module) -> FusedRMSNorm | None:
        if (type(norm) is not FusedRMSNorm or not norm.kernel or norm.form != cls.norm_form or norm._forward_hooks
                or norm._forward_pre_hooks):
            return None
        weight = norm._parameters.get("weight")
        return norm if weight is not None and weight.dtype == cls.dtype and weight.is_contiguous() else None

    @classmethod
    def few_rows(cls, x: torch.Tensor) -> bool:
        """Whether `x` is of this kind's dtype and at most max_rows rows: the cheap half of `takes`, asked first."""
        return x.dtype == cls.dtype and x.numel() <= cls.max_rows * x.shape[-1]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` (a layer's hidden states) goes this way: its dtype, contiguous, a few rows, on the CPU."""
        return (x.dtype == self.dtype and x.is_contiguous() and x.is_cpu and x.shape[-1] == self.width
                and x.numel() <= self.max_rows * self.width)

    def attention_in(self, hidden: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     head_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q/k/v's stacked output [..., qkv width] for the layer's input `hidden` (its input norm first), and
        with `cos` and `sin` (rotary_kernel.rotate's tables for `hidden` [batch, tokens, width]) q's and k's
        heads rotated as rotary_kernel.rotate would: [batch, q and k heads, tokens, head_dim]; None where
        not asked or the tables are not laid out for it."""
        rows = hidden.numel() // self.width
        normed = torch.empty_like(hidden)
        out = torch.empty(*hidden.shape[:-1], self.qkv_width, dtype=self.dtype)
        rotation = self._rotation(hidden, cos, sin, head_dim) if cos is not None else None
        rotated = None if rotation is None else torch.empty((rotation[3], rotation[5], rotation[4], rotation[6]),
                                                            dtype=self.dtype)  # batch, heads, tokens, dim
        self._calls["attention_in"](hidden.data_ptr(), rows, self.width, *self._input_norm, self._lanes,
                                    normed.data_ptr(), *self._qkv, out.data_ptr(), *(rotation or NO_ROTATION),
                                    0 if rotated is None else rotated.data_ptr(), *self._threads())
        return out, rotated

    def _rotation(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int) -> tuple[int, ...] | None:
        """The kernel's rotary arguments (cos, sin, cos batch, batch, tokens, heads, dim), or None where
        rotary_kernel.rotate would not take these tables."""
        if hidden.dim() != 3 or not head_dim or head_dim % 2 or self.qk_width % head_dim:
            return None
        batch, tokens = hidden.shape[:2]
        heads = self.qk_width // head_dim
        if batch * tokens * heads * head_dim > rotary_kernel.MAX_ELEMENTS:
            return None
        for table in (cos, sin):
            if (table.dtype != self.dtype or table.shape[1:] != (1, tokens, head_dim)
                    or table.shape[0] not in (1, batch) or not table.is_contiguous() or not table.is_cpu):
                return None
        return cos.data_ptr(), sin.data_ptr(), cos.shape[0], batch, tokens, heads, head_dim

    def attention_out(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + o_proj(attended), gate/up's stacked output for that after the post-attention norm)."""
        rows = residual.numel() // self.width
        if not attended.is_contiguous():
            attended = attended.contiguous()
        hidden, normed = torch.empty_like(residual), torch.empty_like(residual)
        out = torch.empty(*residual.shape[:-1], self.gate_up_width, dtype=self.dtype)
        self._calls["attention_out"](attended.data_ptr(), rows, self._o_in, *self._o, residual.data_ptr(),
                                     hidden.data_ptr(), self.width, *self._post_norm, self._lanes,
                                     normed.data_ptr(), *self._gate_up, out.data_ptr(), *self._threads())
        return hidden, out

    def mlp_out(self, gated: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down_proj(gated): the layer's output."""
        rows = residual.numel() // self.width
        if not gated.is_contiguous():
            gated = gated.contiguous()
        out = torch.empty_like(residual)
        self._calls["mlp_out"](gated.data_ptr(), rows, self._down_in, *self._down, residual.data_ptr(), self.width,
                               out.data_ptr(), *self._threads())
        return out


def _block_weights(linear: nn.Module) -> block_matmul.BlockWeights | None:
    """`linear`'s block table where its few rows are the bf16 block kernels' alone: a Q4Linear on the Q4 kernel
    (one Q4 part) or a BlockLinear, with no bias or hook, whose outputs fill whole tiles."""
    if type(linear) not in (Q4Linear, BlockLinear) or linear._forward_hooks or linear._forward_pre_hooks:
        return None
    weights = linear.kernel_weights
    if weights is None or linear._parameters.get("bias") is not None or weights.width != weights.out_features:
        return None
    return block_matmul.BlockWeights.of_q4(weights) if type(linear) is Q4Linear else weights


class Q4LayerChain(LayerChain):
    """One q4-bf16 decoder layer's three calls (module docstring): LayerChain on bf16 rows, the block kernels'
    tables and the norm kernel's upcast form."""

    dtype = torch.bfloat16
    norm_form = "upcast"
    max_rows = q4_chain.MAX_ROWS

    @staticmethod
    def calls() -> dict[str, Any] | None:
        return q4_chain.kernel()

    @staticmethod
    def weights_of(linear: nn.Module) -> block_matmul.BlockWeights | None:
        return _block_weights(linear)

    @staticmethod
    def weight_arguments(weights: block_matmul.BlockWeights) -> tuple:
        return weights.table.data_ptr(), weights.parts, weights.tiles

    @staticmethod
    def _threads() -> tuple:
        """The thread count: the block kernels split their tiles in as many shares."""
        return (match_torch_threads(),)
