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
torch's `a + b`; tests/unit/kernels/cpu/test_layer_chain.py holds a model's logits to the unchained layers' bits.

A chain is made per layer where: both norms are FusedRMSNorm on norm_kernel.py's `direct` form (fp32),
q/k/v and gate/up are stacked (shared_input.py) and those two and o_proj / down_proj compute few rows on a
row-kernel copy (OneDnnLinear: row_kernel.copy_of) whose width is its output's (no padding). Anything else,
more than MAX_ROWS rows, or another dtype keeps the layer's usual path (past eight rows the chain's one-thread
norms and adds cost more than its saved calls: 1.01x / 1.03x the plain layers' step at 16 / 32 rows).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from lmi_serve.kernels.cpu import norm_kernel, rotary_kernel, row_kernel
from lmi_serve.kernels.host import omp_threads, require_omp_layer
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.registry import max_rows

log = logging.getLogger(__name__)
# rows a chain takes (kernels/registry.py): at most row_kernel.MAX_ROWS, its matmuls being the row kernel's
MAX_ROWS = max_rows("layer_chain")

try:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import float32_pointer
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
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
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
