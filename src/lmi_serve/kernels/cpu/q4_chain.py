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
order: the unchained layers' bits (tests/unit/kernels/cpu/test_q4_chain.py). A LayerChain whose kind's pieces are
these: lean_layers.py calls either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmi_serve.kernels.cpu import norm_kernel, q4_kernel, rotary_kernel
from lmi_serve.kernels.cpu.layer_chain import compiled_calls
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.registry import max_rows

MAX_ROWS = max_rows("q4_chain")  # kernels/registry.py; at most the Q4 kernel's: more rows go to a layer's dense copy

try:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import bf16, bf16_pointer, byte_pointer, widen
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
    if q4_kernel.kernel() is None or norm_kernel.kernel() is None:
        raise RuntimeError("the Q4 kernel or the norm kernel is unavailable")
    return compiled_calls(_attention_in, _attention_out, _mlp_out)


_compiled = CompiledOnce(_compile, "q4 layer chain unavailable: q4-bf16 decoder layers call their kernels one by one")


def kernel() -> dict[str, Any] | None:
    """The compiled chain calls, or None where numba, the Q4 kernel or the norm kernel is missing."""
    return _compiled.get()
