"""A decoder layer's fp32 matmuls on a few rows in three numba calls, with their norms and residual adds.

At one stream the default's Linear layers run at the weights' bandwidth on the row kernel (row_kernel.py),
and ~5 ms of a ~19 ms SmolLM2 step is the rest: per layer about a dozen Python-level calls between the
kernels (module calls, the norm's and the projections' wrappers, two residual adds), each a few µs. Where a
Llama-family lean layer (lean_layers.py) has every piece on our kernels, its few-row forward runs as

    attention_in:   RMSNorm, q/k/v (one stacked matmul), q and k rotated          -> qkv, rotated q/k
    (the K/V write and attention as before)
    attention_out:  o_proj, + the residual, RMSNorm, then gate/up (stacked)       -> hidden, gate_up
    (SiLU(gate) * up in torch: its exp is not ours to reproduce)
    mlp_out:        down_proj, + the residual                                     -> hidden

each one numba call: the row kernel's tiles (`row_kernel.rows_tile`) in a parallel loop, the norm kernel's
arithmetic (`norm_kernel.inverse_rms`), the rotary kernel's (`rotary_kernel.rotate_heads`; not where per-head
q/k norms come first, Qwen3) and the residual add between, on one thread. Every piece is the
code the separate calls run, in the same order, so the same bits: the residual add is one IEEE sum, as
torch's `a + b`; tests/unit/model/test_layer_chain.py holds a model's logits to the unchained layers' bits.

A chain is made per layer where: both norms are FusedRMSNorm on norm_kernel.py's `direct` form (fp32),
q/k/v and gate/up are stacked (shared_input.py) and those two and o_proj / down_proj compute few rows on a
row-kernel copy (OneDnnLinear: row_kernel.copy_of) whose width is its output's (no padding). Anything else,
more than MAX_ROWS rows, or another dtype keeps the layer's usual path (past eight rows the chain's one-thread
norms and adds cost more than its saved calls: 1.01x / 1.03x the plain layers' step at 16 / 32 rows).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from lmi_serve.model import norm_kernel, rotary_kernel, row_kernel
from lmi_serve.model.fused_norms import FusedRMSNorm
from lmi_serve.model.numba_bits import CompiledOnce, helper, require_omp_layer
from lmi_serve.model.shared_input import SharedInputSlice

log = logging.getLogger(__name__)
MAX_ROWS = 8  # rows a chain takes (at most row_kernel.MAX_ROWS: its matmuls are the row kernel's)

try:
    import numba

    from lmi_serve.model.numba_bits import float32_pointer, match_torch_threads
except ImportError:  # pragma: no cover - a dependency; without it no chain is made
    numba = None


@helper
def _norm_rows(x, rows, width, weight, eps, lanes, out):  # pragma: no cover - numba compiles it
    """out = RMSNorm(x) rows (pointers), norm_kernel.py's `direct` arithmetic."""
    row = np.empty(width, dtype=np.float32)
    for r in range(rows):
        for d in range(width):
            row[d] = x[r * width + d]
        inverse = norm_kernel.inverse_rms(row, eps, lanes)
        for d in range(width):
            out[r * width + d] = (row[d] * inverse) * weight[d]


@helper
def _add_rows(residual, out, length):  # pragma: no cover - numba compiles it
    """out = residual + out, element by element (torch's `residual + out`: one rounding each)."""
    for i in range(length):
        out[i] = residual[i] + out[i]


def _attention_in(x_address, rows, width, norm_address, eps, lanes, normed_address, weights_address, tiles, block,
                  bias_address, out_address, cos_address, sin_address, cos_batch, batch, tokens, heads, dim,
                  rotated_address):  # pragma: no cover - numba compiles it
    x, normed, out = float32_pointer(x_address), float32_pointer(normed_address), float32_pointer(out_address)
    _norm_rows(x, rows, width, float32_pointer(norm_address), eps, lanes, normed)
    weights = float32_pointer(weights_address)
    for tile in numba.prange(tiles):
        row_kernel.rows_tile(normed, rows, width, weights, tiles, block, bias_address, tile, out)
    if rotated_address != 0:  # q's and k's heads rotated, rotary_kernel.py's arithmetic
        out_width = tiles * row_kernel.TILE
        table = (cos_batch, tokens, dim)
        rotary_kernel.rotate_heads(numba.carray(out, (rows * out_width,)),
                                   numba.carray(float32_pointer(cos_address), table),
                                   numba.carray(float32_pointer(sin_address), table),
                                   numba.carray(float32_pointer(rotated_address), (batch, heads, tokens, dim)),
                                   tokens * out_width, out_width)


def _attention_out(a_address, rows, a_width, o_address, o_tiles, o_block, o_bias, residual_address, hidden_address,
                   width, norm_address, eps, lanes, normed_address, gu_address, gu_tiles, gu_block, gu_bias,
                   out_address):  # pragma: no cover - numba compiles it
    a, hidden = float32_pointer(a_address), float32_pointer(hidden_address)
    o_weights = float32_pointer(o_address)
    for tile in numba.prange(o_tiles):
        row_kernel.rows_tile(a, rows, a_width, o_weights, o_tiles, o_block, o_bias, tile, hidden)
    _add_rows(float32_pointer(residual_address), hidden, rows * width)
    normed, out = float32_pointer(normed_address), float32_pointer(out_address)
    _norm_rows(hidden, rows, width, float32_pointer(norm_address), eps, lanes, normed)
    gu_weights = float32_pointer(gu_address)
    for tile in numba.prange(gu_tiles):
        row_kernel.rows_tile(normed, rows, width, gu_weights, gu_tiles, gu_block, gu_bias, tile, out)


def _mlp_out(g_address, rows, g_width, weights_address, tiles, block, bias_address, residual_address, width,
             out_address):  # pragma: no cover - numba compiles it
    g, out, weights = float32_pointer(g_address), float32_pointer(out_address), float32_pointer(weights_address)
    for tile in numba.prange(tiles):
        row_kernel.rows_tile(g, rows, g_width, weights, tiles, block, bias_address, tile, out)
    _add_rows(float32_pointer(residual_address), out, rows * width)


def compiled_calls(attention_in: Any, attention_out: Any, mlp_out: Any) -> dict[str, Any]:
    """A chain kind's three numba functions compiled, by the names LayerChain calls them."""
    numba.config.THREADING_LAYER = "omp"  # the other kernels' layer (engine/kv/decode_kernel.py says why)
    compiled = {name: numba.njit(parallel=True, cache=True, nogil=True)(function)
                for name, function in (("attention_in", attention_in), ("attention_out", attention_out),
                                       ("mlp_out", mlp_out))}
    require_omp_layer()
    return compiled


def _compile() -> dict[str, Any]:
    if row_kernel.kernel() is None or norm_kernel.kernel() is None:
        raise RuntimeError("the row kernel or the norm kernel is unavailable")
    return compiled_calls(_attention_in, _attention_out, _mlp_out)


_compiled = CompiledOnce(_compile, "layer chain unavailable: decoder layers call their kernels one by one")


def kernel() -> dict[str, Any] | None:
    """The compiled chain calls, or None where numba, the row kernel or the norm kernel is missing."""
    return _compiled.get()


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
    kernel; model/q4_chain.py's Q4LayerChain is the bf16 kind on the Q4 kernel, the class attributes and
    static methods below its own."""

    dtype = torch.float32
    norm_form = "direct"  # the FusedRMSNorm form (fused_norms.py) whose arithmetic its calls run
    max_rows = MAX_ROWS

    @staticmethod
    def calls() -> dict[str, Any] | None:
        """The compiled calls, or None where they do not run here."""
        return kernel()

    @staticmethod
    def weights_of(linear: nn.Module) -> Any | None:
        """`linear`'s weights for the calls where its forward of a few rows is theirs alone, or None."""
        return _row_weights(linear)

    @staticmethod
    def weight_arguments(weights: Any) -> tuple:
        """A layer's weights as the calls take them."""
        return weights._weights_address, weights.tiles, weights.block, weights._bias_address

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
        match_torch_threads()
        self._calls["attention_in"](hidden.data_ptr(), rows, self.width, *self._input_norm, self._lanes,
                                    normed.data_ptr(), *self._qkv, out.data_ptr(), *(rotation or NO_ROTATION),
                                    0 if rotated is None else rotated.data_ptr())
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
        match_torch_threads()
        self._calls["attention_out"](attended.data_ptr(), rows, self._o_in, *self._o, residual.data_ptr(),
                                     hidden.data_ptr(), self.width, *self._post_norm, self._lanes,
                                     normed.data_ptr(), *self._gate_up, out.data_ptr())
        return hidden, out

    def mlp_out(self, gated: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down_proj(gated): the layer's output."""
        rows = residual.numel() // self.width
        if not gated.is_contiguous():
            gated = gated.contiguous()
        out = torch.empty_like(residual)
        match_torch_threads()
        self._calls["mlp_out"](gated.data_ptr(), rows, self._down_in, *self._down, residual.data_ptr(), self.width,
                               out.data_ptr())
        return out
