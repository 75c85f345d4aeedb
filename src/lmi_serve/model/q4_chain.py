"""A q4-bf16 decoder layer's few rows in three numba calls: layer_chain.py's chain on the Q4 kernel.

The q4-bf16 opt-in's one-row SmolLM2 step spends ~3.3 ms of ~10 in the Q4 kernel (q4_kernel.py) and most of
the rest in the same dozen Python-level calls a layer as the fp32 default did before layer_chain.py. Where a
Llama-family lean layer's norms are FusedRMSNorm on the norm kernel's `upcast` form (bf16) and its stacked
q/k/v and gate/up, o_proj and down_proj are Q4Linear layers on the Q4 kernel with no bias, its few rows
(<= gguf_linears.Q4_MAX_ROWS) run as layer_chain.py's three calls with bf16 rows:

    attention_in:   RMSNorm, q/k/v, q and k rotated
    attention_out:  o_proj, + the residual, RMSNorm, gate/up
    mlp_out:        down_proj, + the residual

each piece the code the separate calls run (`norm_kernel.upcast_rows`, `q4_kernel.block_sums` and `rows_tile`,
`rotary_kernel.rotate_heads`; the residual add rounded once to bf16, as torch's bf16 `a + b`), in the same
order: the unchained layers' bits (tests/unit/model/test_q4_chain.py). The same interface as LayerChain, so
lean_layers.py calls either.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from lmi_serve.model import norm_kernel, q4_kernel, rotary_kernel
from lmi_serve.model.fused_norms import FusedRMSNorm
from lmi_serve.model.gguf_linears import Q4Linear
from lmi_serve.model.layer_chain import NO_ROTATION, stacked_weights, stacked_sizes
from lmi_serve.model.numba_bits import CompiledOnce, helper, require_omp_layer

MAX_ROWS = 8  # gguf_linears.Q4_MAX_ROWS: more rows go to a layer's dense copy

try:
    import numba

    from lmi_serve.model.numba_bits import bf16, bf16_pointer, byte_pointer, match_torch_threads, widen
except ImportError:  # pragma: no cover - a dependency; without it no chain is made
    numba = None


@helper
def _add_rows(residual, out, length):  # pragma: no cover - numba compiles it
    """out = residual + out in bf16 (bits), each sum rounded once as torch's bf16 add."""
    for i in range(length):
        out[i] = bf16(widen(residual[i]) + widen(out[i]))


@helper
def _matmul(x, rows, width, weights, tiles, out):  # pragma: no cover - numba compiles it
    """out = x times the Q4 weights (q4_kernel's `_q4_rows`, inlined)."""
    blocks = width // q4_kernel.GROUP
    sums = np.empty(rows * blocks, dtype=np.float32)
    q4_kernel.block_sums(x, rows, width, sums)
    for tile in numba.prange(tiles):
        q4_kernel.rows_tile(x, sums, weights, tile, blocks, rows, out, tiles * q4_kernel.TILE)


def _attention_in(x_address, rows, width, norm_address, eps, lanes, normed_address, weights_address, tiles,
                  out_address, cos_address, sin_address, cos_batch, batch, tokens, heads, dim,
                  rotated_address):  # pragma: no cover - numba compiles it
    x, normed, out = bf16_pointer(x_address), bf16_pointer(normed_address), bf16_pointer(out_address)
    norm_kernel.upcast_rows(x, rows, width, bf16_pointer(norm_address), eps, lanes, normed)
    _matmul(normed, rows, width, byte_pointer(weights_address), tiles, out)
    if rotated_address != 0:
        out_width = tiles * q4_kernel.TILE
        table = (cos_batch, tokens, dim)
        rotary_kernel.rotate_heads(numba.carray(out, (rows * out_width,)),
                                   numba.carray(bf16_pointer(cos_address), table),
                                   numba.carray(bf16_pointer(sin_address), table),
                                   numba.carray(bf16_pointer(rotated_address), (batch, heads, tokens, dim)),
                                   tokens * out_width, out_width)


def _attention_out(a_address, rows, a_width, o_address, o_tiles, residual_address, hidden_address, width,
                   norm_address, eps, lanes, normed_address, gu_address, gu_tiles,
                   out_address):  # pragma: no cover - numba compiles it
    hidden = bf16_pointer(hidden_address)
    _matmul(bf16_pointer(a_address), rows, a_width, byte_pointer(o_address), o_tiles, hidden)
    _add_rows(bf16_pointer(residual_address), hidden, rows * width)
    normed = bf16_pointer(normed_address)
    norm_kernel.upcast_rows(hidden, rows, width, bf16_pointer(norm_address), eps, lanes, normed)
    _matmul(normed, rows, width, byte_pointer(gu_address), gu_tiles, bf16_pointer(out_address))


def _mlp_out(g_address, rows, g_width, weights_address, tiles, residual_address, width,
             out_address):  # pragma: no cover - numba compiles it
    out = bf16_pointer(out_address)
    _matmul(bf16_pointer(g_address), rows, g_width, byte_pointer(weights_address), tiles, out)
    _add_rows(bf16_pointer(residual_address), out, rows * width)


def _compile() -> dict[str, Any]:
    if not q4_kernel.available() or norm_kernel.kernel() is None:
        raise RuntimeError("the Q4 kernel or the norm kernel is unavailable")
    numba.config.THREADING_LAYER = "omp"  # the other kernels' layer (engine/kv/decode_kernel.py says why)
    compiled = {name: numba.njit(parallel=True, cache=True, nogil=True)(function)
                for name, function in (("attention_in", _attention_in), ("attention_out", _attention_out),
                                       ("mlp_out", _mlp_out))}
    require_omp_layer()
    return compiled


_compiled = CompiledOnce(_compile, "q4 layer chain unavailable: q4-bf16 decoder layers call their kernels one by one")


def _q4_weights(linear: nn.Module) -> q4_kernel.Q4Weights | None:
    """`linear`'s Q4 kernel weights where its few rows are theirs alone: a Q4Linear with no bias or hook whose
    outputs fill whole tiles."""
    if type(linear) is not Q4Linear or linear._forward_hooks or linear._forward_pre_hooks:
        return None
    weights = linear.kernel_weights
    if weights is None or linear._parameters.get("bias") is not None or weights.width != weights.out_features:
        return None
    return weights


def _norm(norm: nn.Module) -> FusedRMSNorm | None:
    if (type(norm) is not FusedRMSNorm or not norm.kernel or norm.form != "upcast" or norm._forward_hooks
            or norm._forward_pre_hooks):
        return None
    weight = norm._parameters.get("weight")
    return norm if weight is not None and weight.dtype == torch.bfloat16 and weight.is_contiguous() else None


class Q4LayerChain:
    """One q4-bf16 decoder layer's three calls (module docstring), made by `Q4LayerChain.of`; LayerChain's
    interface, on contiguous bf16 rows [..., width] (at most MAX_ROWS of them: `takes`)."""

    def __init__(self, input_norm: FusedRMSNorm, qkv: q4_kernel.Q4Weights, o: q4_kernel.Q4Weights,
                 post_norm: FusedRMSNorm, gate_up: q4_kernel.Q4Weights, down: q4_kernel.Q4Weights):
        self.width = qkv.in_features
        self.qkv_width, self.gate_up_width = qkv.out_features, gate_up.out_features
        self._input_norm = (input_norm.weight.data_ptr(), np.float32(input_norm.variance_epsilon))
        self._post_norm = (post_norm.weight.data_ptr(), np.float32(post_norm.variance_epsilon))
        self._kept = (input_norm.weight, post_norm.weight, qkv, o, gate_up, down)  # alive with their addresses
        self._qkv, self._o, self._gate_up, self._down = ((w.packed.data_ptr(), w.tiles) for w in (qkv, o, gate_up,
                                                                                               down))
        self._o_in, self._down_in = o.in_features, down.in_features
        self.qkv_sizes: list[int] = []
        self.gate_up_sizes: list[int] = []
        self.qk_width = 0
        self._lanes = norm_kernel.kernel()["lanes"]

    @classmethod
    def of(cls, input_norm: nn.Module, qkv: tuple[nn.Module, ...], o: nn.Module, post_norm: nn.Module,
           gate_up: tuple[nn.Module, ...], down: nn.Module) -> "Q4LayerChain | None":
        """The chain of a layer with these children, or None where one of them is not on these kernels."""
        if _compiled.get() is None:
            return None
        pieces = (_norm(input_norm), stacked_weights(qkv, _q4_weights), _q4_weights(o), _norm(post_norm),
                  stacked_weights(gate_up, _q4_weights), _q4_weights(down))
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

    @staticmethod
    def few_bf16_rows(x: torch.Tensor) -> bool:
        """Whether `x` is bf16 and at most MAX_ROWS rows: the cheap half of `takes`, asked first."""
        return x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]

    def takes(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.bfloat16 and x.is_contiguous() and x.is_cpu and x.shape[-1] == self.width
                and x.numel() <= MAX_ROWS * self.width)

    def attention_in(self, hidden: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     head_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """LayerChain.attention_in's answer for bf16 rows."""
        rows = hidden.numel() // self.width
        normed = torch.empty_like(hidden)
        out = torch.empty(*hidden.shape[:-1], self.qkv_width, dtype=torch.bfloat16)
        rotation = self._rotation(hidden, cos, sin, head_dim) if cos is not None else None
        rotated = None if rotation is None else torch.empty((rotation[3], rotation[5], rotation[4], rotation[6]),
                                                            dtype=torch.bfloat16)
        match_torch_threads()
        _compiled.value["attention_in"](hidden.data_ptr(), rows, self.width, *self._input_norm, self._lanes,
                                        normed.data_ptr(), *self._qkv, out.data_ptr(),
                                        *(rotation or NO_ROTATION), 0 if rotated is None else rotated.data_ptr())
        return out, rotated

    def _rotation(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int) -> tuple[int, ...] | None:
        if hidden.dim() != 3 or not head_dim or head_dim % 2 or self.qk_width % head_dim:
            return None
        batch, tokens = hidden.shape[:2]
        heads = self.qk_width // head_dim
        if batch * tokens * heads * head_dim > rotary_kernel.MAX_ELEMENTS:
            return None
        for table in (cos, sin):
            if (table.dtype != torch.bfloat16 or table.shape[1:] != (1, tokens, head_dim)
                    or table.shape[0] not in (1, batch) or not table.is_contiguous() or not table.is_cpu):
                return None
        return cos.data_ptr(), sin.data_ptr(), cos.shape[0], batch, tokens, heads, head_dim

    def attention_out(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + o_proj(attended), gate/up's stacked output for that after the post-attention norm)."""
        rows = residual.numel() // self.width
        if not attended.is_contiguous():
            attended = attended.contiguous()
        hidden, normed = torch.empty_like(residual), torch.empty_like(residual)
        out = torch.empty(*residual.shape[:-1], self.gate_up_width, dtype=torch.bfloat16)
        match_torch_threads()
        _compiled.value["attention_out"](attended.data_ptr(), rows, self._o_in, *self._o, residual.data_ptr(),
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
        _compiled.value["mlp_out"](gated.data_ptr(), rows, self._down_in, *self._down, residual.data_ptr(),
                                   self.width, out.data_ptr())
        return out
