"""A q4-bf16 decoder layer's few rows in three numba calls: layer_chain.py's chain on the bf16 block kernels.

The q4-bf16 opt-in's one-row SmolLM2 step spends ~3.3 ms of ~10 in the Q4 kernel (q4_kernel.py) and most of
the rest in the same dozen Python-level calls a layer as the fp32 default did before layer_chain.py. Where a
Llama-family lean layer's norms are FusedRMSNorm on the norm kernel's `upcast` form (bf16) and its stacked
q/k/v and gate/up, o_proj and down_proj run on the bf16 block kernels with no bias (Q4Linear on the Q4 kernel,
BlockLinear on block_matmul.py: Q5_0, Q6_K, Q8_0 and mixes, as a Q4_K_M file holds them), its few rows
(<= gguf_linears.Q4_MAX_ROWS) run as layer_chain.py's three calls with bf16 rows:

    attention_in:   RMSNorm, q/k/v, q and k rotated
    attention_out:  o_proj, + the residual, RMSNorm, gate/up
    mlp_out:        down_proj, + the residual

each piece the code the separate calls run (`norm_kernel.upcast_rows`, `block_matmul.matmul`: the formats' own
tile functions and sums, `rotary_kernel.rotate_heads`; the residual add rounded once to bf16, as torch's bf16
`a + b`), in the same order: the unchained layers' bits (tests/unit/kernels/cpu/test_q4_chain.py). Each matmul
is given as its block table (block_matmul.BlockWeights: a Q4 layer's is one Q4 part) and splits its tiles into
one share of about equal bytes per thread. A LayerChain whose kind's pieces are these: lean_layers.py calls
either.

Numba's cache of these calls checks this file only: block_matmul.py's `matmul` is compiled into them, so a
change there needs this file touched (or the cache cleared), or the calls run the old code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmi_serve.kernels.cpu import block_matmul, norm_kernel, rotary_kernel
from lmi_serve.kernels.cpu.layer_chain import compiled_calls
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.registry import max_rows

MAX_ROWS = max_rows("q4_chain")  # kernels/registry.py; at most the block kernels': more rows go to a layer's dense copy

try:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import bf16, bf16_pointer, int64_pointer, widen
except ImportError:  # pragma: no cover - a dependency; without it no chain is made
    numba = None


@helper
def _add_rows(residual, out, length):  # pragma: no cover - numba compiles it
    """out = residual + out in bf16 (bits), each sum rounded once as torch's bf16 add."""
    for i in range(length):
        out[i] = bf16(widen(residual[i]) + widen(out[i]))


@helper
def _matmul(x, rows, width, table_address, parts, tiles, out, threads):  # pragma: no cover - numba compiles it
    """out = x times the layer whose block table is at `table_address` (block_matmul's kernel, inlined)."""
    block_matmul.matmul(x, rows, int64_pointer(table_address), parts, tiles, width // block_matmul.GROUP, out,
                        threads)


def _attention_in(x_address, rows, width, norm_address, eps, lanes, normed_address, table_address, parts, tiles,
                  out_address, cos_address, sin_address, cos_batch, batch, tokens, heads, dim,
                  rotated_address, threads):  # pragma: no cover - numba compiles it
    x, normed, out = bf16_pointer(x_address), bf16_pointer(normed_address), bf16_pointer(out_address)
    norm_kernel.upcast_rows(x, rows, width, bf16_pointer(norm_address), eps, lanes, normed)
    _matmul(normed, rows, width, table_address, parts, tiles, out, threads)
    if rotated_address != 0:
        out_width = tiles * block_matmul.TILE
        table = (cos_batch, tokens, dim)
        rotary_kernel.rotate_heads(numba.carray(out, (rows * out_width,)),
                                   numba.carray(bf16_pointer(cos_address), table),
                                   numba.carray(bf16_pointer(sin_address), table),
                                   numba.carray(bf16_pointer(rotated_address), (batch, heads, tokens, dim)),
                                   tokens * out_width, out_width)


def _attention_out(a_address, rows, a_width, o_address, o_parts, o_tiles, residual_address, hidden_address, width,
                   norm_address, eps, lanes, normed_address, gu_address, gu_parts, gu_tiles,
                   out_address, threads):  # pragma: no cover - numba compiles it
    hidden = bf16_pointer(hidden_address)
    _matmul(bf16_pointer(a_address), rows, a_width, o_address, o_parts, o_tiles, hidden, threads)
    _add_rows(bf16_pointer(residual_address), hidden, rows * width)
    normed = bf16_pointer(normed_address)
    norm_kernel.upcast_rows(hidden, rows, width, bf16_pointer(norm_address), eps, lanes, normed)
    _matmul(normed, rows, width, gu_address, gu_parts, gu_tiles, bf16_pointer(out_address), threads)


def _mlp_out(g_address, rows, g_width, table_address, parts, tiles, residual_address, width,
             out_address, threads):  # pragma: no cover - numba compiles it
    out = bf16_pointer(out_address)
    _matmul(bf16_pointer(g_address), rows, g_width, table_address, parts, tiles, out, threads)
    _add_rows(bf16_pointer(residual_address), out, rows * width)


def _compile() -> dict[str, Any]:
    if block_matmul.kernel() is None or norm_kernel.kernel() is None:
        raise RuntimeError("the block kernel or the norm kernel is unavailable")
    return compiled_calls(_attention_in, _attention_out, _mlp_out)


_compiled = CompiledOnce(_compile, "q4 layer chain unavailable: q4-bf16 decoder layers call their kernels one by one")


def kernel() -> dict[str, Any] | None:
    """The compiled chain calls, or None where numba, the block kernel or the norm kernel is missing."""
    return _compiled.get()
