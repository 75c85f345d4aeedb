"""A GGUF's Q4 weights times a few bf16 rows on AVX-512 BF16 (kernels/layers/gguf_linears.py: up to Q4_MAX_ROWS).

The q4-bf16 opt-in's one-row step spent ~4 ms of ~12 in torch's int4 kernel (`_weight_int4pack_mm_for_cpu`:
120 calls a SmolLM2 step at ~13 GB/s, much of it in its threads' barrier). This kernel reads each weight
once as a 16-bit word that is exactly the bf16 of 128 + q (0x43 above the nibble: bf16 steps by 1 between
128 and 256), so no integer-to-float conversion: per 64 bytes (128 weights) one load, a mask, a shift and a
mask, four byte interleaves with 0x43 (`vpunpck[lh]bw`) and four `vdpbf16ps` (16 lanes of two bf16 products
added to fp32). The block's scale d and minimum m (w = d q + m, the GGUF's fp16, kept exactly) are applied
per 32 columns in fp32:

    sum_k w[n, k] x[k] = sum_blocks d[n, b] sum_j (128 + q[n, j]) x[j] + (m[n, b] - 128 d[n, b]) sum_j x[j]

The activations are the bf16 rows as they are (the products are exact in fp32; `vdpbf16ps` flushes
subnormal inputs and outputs to zero), the result rounded to bf16 (nearest even). Against fp64 of the same
weights its error is ~1e-6 before that rounding; torch's kernel rounds the scales to bf16 first (~1e-2).

Rows go four at a time (each weight word made once for the four), a last two or one on loops of their own
(two rows through the four-row loop took 1.3x their own loop's time), with the same arithmetic for every row
either way: a row's bits do not depend on the batch. Measured (benchmarks/journal/2026-11.md,
2-core EPYC): SmolLM2's 120 Q4 calls at one row 0.65-0.80x torch's time cold, a one-row step 0.875-0.91x.
Cold, it reads ~20 GB/s where the box's plain sum reads ~30: the interleaves (against a widen and an or a
word) made it 0.91x hot and level cold; a software prefetch 512-4096 bytes ahead did not pay.

Layout (`pack`): per tile of 32 outputs and per block of 32 input columns, 640 bytes: 8 chunks of 64 bytes,
chunk c holding column pairs 2c (low nibbles) and 2c + 1 (high nibbles); its byte 16 L + j (L in 0..3, j in
0..15) is output 4 L + (j % 8) // 2, plus 16 where j >= 8, column j % 2 of the pair: the order in which the
interleaves within 128-bit lanes put the words. Then d for the 32 outputs (fp16), then m (fp16): the GGUF's
20 bytes per 32 weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmi_serve.kernels.host import cpu_has, omp_threads, require_omp_layer
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, callee, helper
from lmi_serve.kernels.registry import KERNELS

GROUP = 32  # input columns per block (a GGUF Q4 block)
TILE = 32  # outputs per tile: two 16-lane vectors
_CHUNK = 64  # bytes: two column pairs of a tile
_CHUNKS = GROUP // 4  # per block: 8
_NIBBLE_BYTES = _CHUNKS * _CHUNK  # 512
_BLOCK_BYTES = _NIBBLE_BYTES + 2 * TILE * 2  # + d and m, fp16 each: 640
BLOCK_BYTES = _BLOCK_BYTES
_D_AT, _M_AT = _NIBBLE_BYTES, _NIBBLE_BYTES + TILE * 2
_OFFSET = 128  # the words hold 128 + q

try:
    import numba

    from lmi_serve.kernels.cpu.bf16_ir import add as _add, dot as _dot, fma_scalar as _fma_scalar
    from lmi_serve.kernels.cpu.bf16_ir import fma_vector as _fma_vector, halves16 as _halves16, pair as _pair
    from lmi_serve.kernels.cpu.bf16_ir import store_bf16 as _store_bf16, words as _words
    from lmi_serve.kernels.cpu.numba_bits import bf16_pointer, byte_pointer, float32_pointer, held, match_torch_threads
    from lmi_serve.kernels.cpu.numba_bits import widen, zeros16
except ImportError:  # pragma: no cover - a dependency; without it `kernel()` is None
    numba = None


if numba is not None:
    _even_low, _even_high = _words(False, False), _words(False, True)  # pair 2c: outputs 0-15, 16-31
    _odd_low, _odd_high = _words(True, False), _words(True, True)  # pair 2c + 1


@helper
def block_sums(x, rows, columns, sums):  # pragma: no cover - numba compiles it
    """sums[r, b]: row r's 32 columns of block b added in fp32, in order (the m term's factor)."""
    blocks = columns // GROUP
    for r in range(rows):
        for b in range(blocks):
            total = np.float32(0)
            for j in range(GROUP):
                total += widen(x[r * columns + b * GROUP + j])
            sums[r * blocks + b] = total


@helper
def _scaled(total, weights, at, half, even, odd, x_sum):  # pragma: no cover - numba compiles it
    """total + d (even + odd) + (m - 128 d) x_sum for the outputs `half` (0: the tile's first 16, 1: the rest)."""
    d = _halves16(weights, at + _D_AT + 32 * half)
    minimum = _fma_scalar(_halves16(weights, at + _M_AT + 32 * half), d, np.float32(-_OFFSET))
    return _fma_scalar(_fma_vector(total, d, _add(even, odd)), minimum, x_sum)


@helper
def _one_row(x, sums, weights, tile, blocks, row, out, width):  # pragma: no cover - numba compiles it
    columns = blocks * GROUP
    low, high = zeros16(), zeros16()
    for b in range(blocks):
        at, xa = (tile * blocks + b) * _BLOCK_BYTES, row * columns + b * GROUP
        even_low, even_high, odd_low, odd_high = zeros16(), zeros16(), zeros16(), zeros16()
        for c in range(_CHUNKS):  # even and odd pairs in two chains each: fewer waits on vdpbf16ps
            chunk, pair = at + c * _CHUNK, _pair(x, xa + 4 * c)
            even_low = _dot(even_low, _even_low(weights, chunk), pair)
            even_high = _dot(even_high, _even_high(weights, chunk), pair)
            pair = _pair(x, xa + 4 * c + 2)
            odd_low = _dot(odd_low, _odd_low(weights, chunk), pair)
            odd_high = _dot(odd_high, _odd_high(weights, chunk), pair)
        x_sum = sums[row * blocks + b]
        low = _scaled(low, weights, at, 0, even_low, odd_low, x_sum)
        high = _scaled(high, weights, at, 1, even_high, odd_high, x_sum)
    _store_bf16(out, row * width + tile * TILE, low)
    _store_bf16(out, row * width + tile * TILE + 16, high)


@helper
def store_tile_rows(out, at, width, count, low0, high0, low1, high1, low2, high2, low3,
                    high3):  # pragma: no cover - numba compiles it
    """A tile's 32 outputs of up to four rows (`count` of them, the first always), rounded to bf16, row r at
    out[at + r * width]: the four-row kernels' store (here and wide_kernel.py)."""
    _store_bf16(out, at, low0)
    _store_bf16(out, at + 16, high0)
    if count > 1:
        _store_bf16(out, at + width, low1)
        _store_bf16(out, at + width + 16, high1)
    if count > 2:
        _store_bf16(out, at + 2 * width, low2)
        _store_bf16(out, at + 2 * width + 16, high2)
    if count > 3:
        _store_bf16(out, at + 3 * width, low3)
        _store_bf16(out, at + 3 * width + 16, high3)


@helper
def _four_rows(x, sums, weights, tile, blocks, first, rows, out, width):  # pragma: no cover - numba compiles it
    """Rows first..first + 3 (those past `rows` repeat `first`: computed, not stored), each row's arithmetic
    `_one_row`'s."""
    columns = blocks * GROUP
    r1 = first + 1 if first + 1 < rows else first
    r2 = first + 2 if first + 2 < rows else first
    r3 = first + 3 if first + 3 < rows else first
    low0, high0, low1, high1 = zeros16(), zeros16(), zeros16(), zeros16()
    low2, high2, low3, high3 = zeros16(), zeros16(), zeros16(), zeros16()
    for b in range(blocks):
        at = (tile * blocks + b) * _BLOCK_BYTES
        x0, x1, x2, x3 = first * columns + b * GROUP, r1 * columns + b * GROUP, r2 * columns + b * GROUP, \
            r3 * columns + b * GROUP
        el0, eh0, ol0, oh0 = zeros16(), zeros16(), zeros16(), zeros16()
        el1, eh1, ol1, oh1 = zeros16(), zeros16(), zeros16(), zeros16()
        el2, eh2, ol2, oh2 = zeros16(), zeros16(), zeros16(), zeros16()
        el3, eh3, ol3, oh3 = zeros16(), zeros16(), zeros16(), zeros16()
        for c in range(_CHUNKS):
            chunk, p = at + c * _CHUNK, 2 * c
            words_low, words_high = _even_low(weights, chunk), _even_high(weights, chunk)
            pair = _pair(x, x0 + 2 * p)
            el0, eh0 = _dot(el0, words_low, pair), _dot(eh0, words_high, pair)
            pair = _pair(x, x1 + 2 * p)
            el1, eh1 = _dot(el1, words_low, pair), _dot(eh1, words_high, pair)
            pair = _pair(x, x2 + 2 * p)
            el2, eh2 = _dot(el2, words_low, pair), _dot(eh2, words_high, pair)
            pair = _pair(x, x3 + 2 * p)
            el3, eh3 = _dot(el3, words_low, pair), _dot(eh3, words_high, pair)
            words_low, words_high = _odd_low(weights, chunk), _odd_high(weights, chunk)
            pair = _pair(x, x0 + 2 * p + 2)
            ol0, oh0 = _dot(ol0, words_low, pair), _dot(oh0, words_high, pair)
            pair = _pair(x, x1 + 2 * p + 2)
            ol1, oh1 = _dot(ol1, words_low, pair), _dot(oh1, words_high, pair)
            pair = _pair(x, x2 + 2 * p + 2)
            ol2, oh2 = _dot(ol2, words_low, pair), _dot(oh2, words_high, pair)
            pair = _pair(x, x3 + 2 * p + 2)
            ol3, oh3 = _dot(ol3, words_low, pair), _dot(oh3, words_high, pair)
        low0 = _scaled(low0, weights, at, 0, el0, ol0, sums[first * blocks + b])
        high0 = _scaled(high0, weights, at, 1, eh0, oh0, sums[first * blocks + b])
        low1 = _scaled(low1, weights, at, 0, el1, ol1, sums[r1 * blocks + b])
        high1 = _scaled(high1, weights, at, 1, eh1, oh1, sums[r1 * blocks + b])
        low2 = _scaled(low2, weights, at, 0, el2, ol2, sums[r2 * blocks + b])
        high2 = _scaled(high2, weights, at, 1, eh2, oh2, sums[r2 * blocks + b])
        low3 = _scaled(low3, weights, at, 0, el3, ol3, sums[r3 * blocks + b])
        high3 = _scaled(high3, weights, at, 1, eh3, oh3, sums[r3 * blocks + b])
    store_tile_rows(out, first * width + tile * TILE, width, rows - first, low0, high0, low1, high1, low2, high2,
                    low3, high3)


@helper
def _two_rows(x, sums, weights, tile, blocks, first, out, width):  # pragma: no cover - numba compiles it
    """Rows first and first + 1, each row's arithmetic `_one_row`'s."""
    columns = blocks * GROUP
    low0, high0, low1, high1 = zeros16(), zeros16(), zeros16(), zeros16()
    for b in range(blocks):
        at = (tile * blocks + b) * _BLOCK_BYTES
        x0, x1 = first * columns + b * GROUP, (first + 1) * columns + b * GROUP
        el0, eh0, ol0, oh0 = zeros16(), zeros16(), zeros16(), zeros16()
        el1, eh1, ol1, oh1 = zeros16(), zeros16(), zeros16(), zeros16()
        for c in range(_CHUNKS):
            chunk, p = at + c * _CHUNK, 2 * c
            words_low, words_high = _even_low(weights, chunk), _even_high(weights, chunk)
            pair = _pair(x, x0 + 2 * p)
            el0, eh0 = _dot(el0, words_low, pair), _dot(eh0, words_high, pair)
            pair = _pair(x, x1 + 2 * p)
            el1, eh1 = _dot(el1, words_low, pair), _dot(eh1, words_high, pair)
            words_low, words_high = _odd_low(weights, chunk), _odd_high(weights, chunk)
            pair = _pair(x, x0 + 2 * p + 2)
            ol0, oh0 = _dot(ol0, words_low, pair), _dot(oh0, words_high, pair)
            pair = _pair(x, x1 + 2 * p + 2)
            ol1, oh1 = _dot(ol1, words_low, pair), _dot(oh1, words_high, pair)
        low0 = _scaled(low0, weights, at, 0, el0, ol0, sums[first * blocks + b])
        high0 = _scaled(high0, weights, at, 1, eh0, oh0, sums[first * blocks + b])
        low1 = _scaled(low1, weights, at, 0, el1, ol1, sums[(first + 1) * blocks + b])
        high1 = _scaled(high1, weights, at, 1, eh1, oh1, sums[(first + 1) * blocks + b])
    at = first * width + tile * TILE
    _store_bf16(out, at, low0)
    _store_bf16(out, at + 16, high0)
    _store_bf16(out, at + width, low1)
    _store_bf16(out, at + width + 16, high1)


@callee
def rows_tiles(x, sums, weights, first_tile, end_tile, blocks, rows, out, width):  # pragma: no cover - numba
    """Tiles first_tile..end_tile - 1 (32 outputs each) of every row (`_q4_rows`' per-thread share;
    kernels/cpu/block_matmul.py's for Q4 parts): x and out bf16 pointers (out rows `width` apart), sums a pointer
    to the rows' `block_sums`, weights a byte pointer."""
    for tile in range(first_tile, end_tile):
        for first in range(0, rows, 4):
            if rows - first == 1:
                _one_row(x, sums, weights, tile, blocks, first, out, width)
            elif rows - first == 2:
                _two_rows(x, sums, weights, tile, blocks, first, out, width)
            else:
                _four_rows(x, sums, weights, tile, blocks, first, rows, out, width)


def _q4_rows(x_address, rows, weights_address, tiles, blocks, out_address, threads):  # pragma: no cover - numba
    """out [rows, tiles * 32] (bf16) = x [rows, blocks * 32] (bf16) times the packed weights' transpose, in
    `threads` shares."""
    x, out, weights = bf16_pointer(x_address), bf16_pointer(out_address), byte_pointer(weights_address)
    sums = np.empty(rows * blocks, dtype=np.float32)
    block_sums(x, rows, blocks * GROUP, sums)
    at = float32_pointer(sums.ctypes.data)  # an array argument would be counted (an atomic) on each call
    for thread in numba.prange(threads):  # a contiguous share of the tiles each, as prange's own split
        rows_tiles(x, at, weights, thread * tiles // threads, (thread + 1) * tiles // threads, blocks, rows, out,
                   tiles * TILE)
    held(sums)


class Q4Weights:
    """A layer's Q4 weights in the kernel's layout; called on contiguous bf16 rows [M, K] it returns [M, N]
    bf16. Only where `kernel()` is not None."""

    def __init__(self, packed: torch.Tensor, out_features: int):
        self.packed, self.out_features = packed, out_features  # uint8 [tiles, blocks, 640]
        self.tiles, self.blocks = packed.shape[:2]
        # looked up once: a call took ~8 µs where each was looked up every time, ~2.5 of it numba's dispatch
        self.in_features, self.width = self.blocks * GROUP, self.tiles * TILE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _call(_compiled.value, self, x)


def pack(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Q4Weights:
    """gguf_linears.Q4Blocks' fields (weight = (q - 8) scale + zero per 32 columns; q in 0..15, scale the GGUF's
    fp16 d, zero its m + 8 d) in the kernel's layout. Raises ValueError where K is not whole blocks."""
    out_features, in_features = q.shape
    if in_features % GROUP or scale.shape != (out_features, in_features // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"q {q.shape}, scale {scale.shape}, zero {zero.shape}: the kernel takes blocks of {GROUP}")
    tiles, blocks = -(-out_features // TILE), in_features // GROUP
    padded = np.zeros((tiles * TILE, in_features), np.uint8)
    padded[:out_features] = q
    # output 16 half + 4 lane + i, column 4 c + 2 parity + col of block b -> chunk byte 16 lane + 8 half + 2 i + col,
    # parity 0 in the low nibble: [tile, half, lane, i, block, c, parity, col] -> [tile, block, c, lane, half, i,
    # col, parity]
    nibbles = padded.reshape(tiles, 2, 4, 4, blocks, _CHUNKS, 2, 2).transpose(0, 4, 5, 2, 1, 3, 7, 6)
    nibbles = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, blocks, _NIBBLE_BYTES)

    def per_tile(values: np.ndarray) -> np.ndarray:
        out = np.zeros((tiles * TILE, blocks), np.float16)
        out[:out_features] = values
        return out.reshape(tiles, TILE, blocks).transpose(0, 2, 1).copy().view(np.uint8).reshape(tiles, blocks, -1)

    minimum = zero - 8 * scale  # the GGUF's m (Q4_0: -8 d), exact in fp16 (Q4_K's -dmin m_j: rounded to it)
    laid_out = np.concatenate([nibbles, per_tile(scale), per_tile(minimum)], axis=-1)
    return Q4Weights(torch.from_numpy(np.ascontiguousarray(laid_out)), out_features)


def unpacked(weights: Q4Weights) -> np.ndarray:
    """The fp32 weights [N, K] a packed layer holds (for tests)."""
    laid_out = weights.packed.numpy()
    tiles, blocks = laid_out.shape[:2]
    nibbles = laid_out[..., :_NIBBLE_BYTES].reshape(tiles, blocks, _CHUNKS, 4, 2, 4, 2)
    q = np.stack([nibbles & 15, nibbles >> 4], axis=-1)  # tile, block, c, lane, half, i, col, parity (pack's)
    q = q.transpose(0, 4, 3, 5, 1, 2, 7, 6).reshape(tiles * TILE, blocks * GROUP).astype(np.float32)

    def per_output(at: int) -> np.ndarray:
        values = laid_out[..., at:at + TILE * 2].copy().view(np.float16).astype(np.float32)  # tile, block, 32
        return np.repeat(values.transpose(0, 2, 1).reshape(tiles * TILE, blocks), GROUP, axis=1)

    return (q * per_output(_D_AT) + per_output(_M_AT))[:weights.out_features]


def _call(compiled: Any, weights: Q4Weights, x: torch.Tensor) -> torch.Tensor:
    # the kernel reads x by its address: its layout is checked here. The weights' address is read each call:
    # a module's buffer may be given new storage (kernels/layers/surgery.py's own_remaining_tensors does)
    shape = x.shape
    if x.dtype != torch.bfloat16 or len(shape) != 2 or shape[1] != weights.in_features or not shape[0] \
            or not x.is_contiguous():
        raise ValueError(f"the Q4 kernel takes contiguous bf16 rows of {weights.in_features}, not {x.dtype} "
                         f"{list(shape)}")
    out = torch.empty((shape[0], weights.width), dtype=torch.bfloat16)
    compiled(x.data_ptr(), shape[0], weights.packed.data_ptr(), weights.tiles, weights.blocks, out.data_ptr(),
             match_torch_threads())
    return out if weights.width == weights.out_features else out[:, :weights.out_features]


def _compile() -> Any:
    if not cpu_has(*KERNELS["q4"].cpu_features):
        raise RuntimeError("the CPU has no AVX-512 BF16")
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
    compiled = numba.njit(parallel=True, cache=True, nogil=True)(_q4_rows)
    # compile now (start-up) and check against fp64 of the same weights
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.001, 0.01, (40, 2)).astype(np.float16).astype(np.float32)
    zero = (rng.uniform(-0.08, 0, (40, 2)).astype(np.float16).astype(np.float32) + 8 * scale).astype(np.float32)
    weights = pack(rng.integers(0, 16, (40, 64)).astype(np.uint8), scale, zero)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = _call(compiled, weights, x).double()
    want = x.double() @ torch.from_numpy(unpacked(weights)).double().T
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()):
        raise RuntimeError(f"its self-check failed (max difference {(got - want).abs().max().item()})")
    require_omp_layer()
    return compiled


_compiled = CompiledOnce(_compile, "Q4 kernel unavailable: bf16 Q4 layers keep torch's int4 kernel")


def kernel() -> Any | None:
    """The compiled kernel, or None where numba, its OpenMP layer or AVX-512 BF16 is missing (logged once)."""
    return _compiled.get()
