"""A GGUF's Q5_0, Q6_K and Q8_0 weights times a few bf16 rows: the Q4 kernel's arithmetic (q4_kernel.py) on
wider codes. kernels/cpu/block_matmul.py calls these tiles, each layer part by its format.

Each weight is read as the bf16 word of 128 + q (bf16_ir.py: exact for q < 128), so the products need no
conversion, and each block's scales are the GGUF's own, applied in fp32:

- Q5_0 (w = d (q - 16), q 5 bits, fp16 d per 32): the low nibbles as in Q4's layout, the fifth bit as one bit
  plane per 64 codes (`bf16_ir.words`): sum w x = d sum (128 + q) x - 144 d sum x.
- Q6_K (w = d sc (q - 32), q 6 bits, int8 sc per 16 columns, fp16 d per 256): two bit planes; the scale
  d sc (exact in fp32: an fp16 times an int8) is applied per 16 columns (four chunks), with the rows' sums
  per 16 columns: sum w x = sum_halves d sc (sum (128 + q) x - 160 sum x).
- Q8_0 (w = d q, q int8, fp16 d per 32): u = q + 128 is a byte whose two nibbles l, h are each a word of the
  same column (a chunk is one column pair, not two): sum w x = d (L + 16 H) - 2304 d sum x, with L and H the
  dot products of 128 + l and 128 + h.

Layouts (`pack`), per tile of 32 outputs and block of 32 columns: chunks of 64 nibble bytes in q4_kernel.py's
order (Q8_0: chunk c holds pair c, the byte's two nibbles), each followed by its bit planes (Q5_0: 16 bytes,
Q6_K: 32), then the scales: Q5_0 d (fp16 x 32): 704 bytes a block (0.69 a weight, Q4_1's 0.63); Q6_K sc
(int8, [column half][32]) and its super-block's d (fp16 x 32, repeated per block): 896 (0.88); Q8_0 d: 1,088
(1.06, as the GGUF). Rows go four, two and one at a time with the same arithmetic for each row, as in
q4_kernel.py: a row's bits do not depend on the batch. `fmt` is a constant at each call site, so LLVM keeps
one format's code in each copy.
"""

from __future__ import annotations

import numpy as np

from lmi_serve.kernels.cpu.bf16_ir import CHUNK, PLANE
from lmi_serve.kernels.cpu.numba_bits import callee, helper

Q5_0, Q6_K, Q8_0 = 1, 2, 3  # block_matmul.py's format numbers (0: q4_kernel.py's layout)
KINDS = {"Q5_0": Q5_0, "Q6_K": Q6_K, "Q8_0": Q8_0}
OFFSETS = {Q5_0: 16, Q6_K: 32, Q8_0: 128}  # w = scale (code - offset)
_PLANES = {Q5_0: 1, Q6_K: 2, Q8_0: 0}  # bit planes above each nibble
GROUP = 32  # columns per block
TILE = 32  # outputs per tile
_Q5_CHUNK, _Q6_CHUNK = CHUNK + 2 * PLANE, CHUNK + 4 * PLANE  # nibbles and each nibble's planes
_Q5_D = 8 * _Q5_CHUNK  # 640
_Q6_SC = 8 * _Q6_CHUNK  # 768: int8 [2 column halves][32 outputs]
_Q6_D = _Q6_SC + 2 * TILE  # 832
_Q8_D = 16 * CHUNK  # 1024
BLOCK_BYTES = {Q5_0: _Q5_D + 2 * TILE, Q6_K: _Q6_D + 2 * TILE, Q8_0: _Q8_D + 2 * TILE}

_CHUNK_BYTES = {Q5_0: _Q5_CHUNK, Q6_K: _Q6_CHUNK, Q8_0: CHUNK}
_CHUNKS = {Q5_0: 8, Q6_K: 8, Q8_0: 16}  # per block: Q8_0's chunk is one column pair
_PARTS = {Q5_0: 1, Q6_K: 2, Q8_0: 1}  # scales per block along the columns: Q6_K's per 16
# d's byte in a block, the minimum's factor (-(128 + offset): the words are 128 + q), Q6_K's sc
_D_AT = {Q5_0: _Q5_D, Q6_K: _Q6_D, Q8_0: _Q8_D}
_MINIMUM = {Q5_0: -144.0, Q6_K: -160.0, Q8_0: -2304.0}  # Q8_0: (l + 16 h) - 128 * 17 - 128

try:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    from lmi_serve.kernels.cpu.bf16_ir import SHORTS32, chunk_words, dot, fma, fp16s, int8s, pair, spread
    from lmi_serve.kernels.cpu.bf16_ir import store_bf16
    from lmi_serve.kernels.cpu.q4_kernel import store_tile_rows
    from lmi_serve.kernels.cpu.numba_bits import FLOAT32x16, FLOATS16, widen, zeros16
except ImportError:  # pragma: no cover - a dependency; without it block_matmul.kernel() is None
    numba = None

# The format-specific pieces are intrinsics of a constant `fmt` (numba gives them its literal through the
# inlined helpers below): each call site's code is its format's alone, with no branch on it, and numba
# copies no helper's IR per format (what made a branching version compile for minutes).
if numba is not None:
    _I64 = ir.IntType(64)

    def _format(fmt) -> int | None:
        return fmt.literal_value if isinstance(fmt, types.IntegerLiteral) else None

    @intrinsic(prefer_literal=True)
    def _shape(typingctx, fmt):
        """(block bytes, chunk bytes, chunks, scale parts) of the format."""
        f = _format(fmt)
        if f is None:
            return None
        values = (BLOCK_BYTES[f], _CHUNK_BYTES[f], _CHUNKS[f], _PARTS[f])

        def codegen(context, builder, signature, args):
            return context.make_tuple(builder, signature.return_type, [ir.Constant(_I64, v) for v in values])
        return types.UniTuple(types.int64, 4)(fmt), codegen

    @intrinsic(prefer_literal=True)
    def _chunk_words(typingctx, fmt, weights, chunk):
        """The chunk's words at the byte weights[chunk]: low nibbles' (outputs 0-15, 16-31), then high ones'."""
        f = _format(fmt)
        if f is None:
            return None

        def codegen(context, builder, signature, args):
            made = [chunk_words(builder, args[1], args[2], high, upper, _PLANES[f])
                    for high in (False, True) for upper in (False, True)]
            return context.make_tuple(builder, signature.return_type, made)
        return types.UniTuple(SHORTS32, 4)(fmt, weights, chunk), codegen

    @intrinsic(prefer_literal=True)
    def _columns(typingctx, fmt, c):
        """The block columns of chunk c's low- and high-nibble words' pairs."""
        f = _format(fmt)
        if f is None:
            return None

        def codegen(context, builder, signature, args):
            if f == Q8_0:
                first = builder.mul(args[1], ir.Constant(_I64, 2))
                return context.make_tuple(builder, signature.return_type, [first, first])
            first = builder.mul(args[1], ir.Constant(_I64, 4))
            return context.make_tuple(builder, signature.return_type, [first, builder.add(first, ir.Constant(_I64, 2))])
        return types.UniTuple(types.int64, 2)(fmt, c), codegen

    @intrinsic(prefer_literal=True)
    def _scaled(typingctx, fmt, total, weights, at, half, part, low, high, x_sum):
        """total + the block's share (Q6_K: its column half `part`'s) for the outputs `half` (0: 0-15, 1: 16-31),
        from the low- and high-nibble words' dot products and the row's sum over those columns:
        scale (low + high) + minimum x_sum (Q8_0: d (low + 16 high) + ...), scale and minimum exact in fp32."""
        f = _format(fmt)
        if f is None:
            return None

        def codegen(context, builder, signature, args):
            _, total_, weights_, at_, half_, part_, low_, high_, x_sum_ = args
            by_half = builder.mul(half_, ir.Constant(_I64, 32))
            scale = fp16s(builder, weights_, builder.add(at_, builder.add(by_half, ir.Constant(_I64, _D_AT[f]))))
            if f == Q6_K:  # d sc: an fp16 times an int8, exact
                sc_at = builder.add(builder.mul(part_, ir.Constant(_I64, TILE)), ir.Constant(_I64, _Q6_SC))
                sc_at = builder.add(at_, builder.add(sc_at, builder.mul(half_, ir.Constant(_I64, 16))))
                scale = builder.fmul(scale, int8s(builder, weights_, sc_at))
            if f == Q8_0:
                words = fma(builder, high_, ir.Constant(FLOATS16, [16.0] * 16), low_)
            else:
                words = builder.fadd(low_, high_)
            minimum = builder.fmul(scale, ir.Constant(FLOATS16, [_MINIMUM[f]] * 16))
            return fma(builder, minimum, spread(builder, x_sum_), fma(builder, scale, words, total_))
        return FLOAT32x16(fmt, total, weights, at, half, part, low, high, x_sum), codegen


@helper
def half_sums(x, rows, columns, sums):  # pragma: no cover - numba compiles it
    """sums[r, j]: row r's 16 columns of group j added in fp32, in order (Q6_K's minimum term's factor)."""
    groups = columns // 16
    for r in range(rows):
        for j in range(groups):
            total = np.float32(0)
            for i in range(16):
                total += widen(x[r * columns + j * 16 + i])
            sums[r * groups + j] = total


@helper
def _one_row(fmt, x, sums, weights, tile, blocks, row, out, width):  # pragma: no cover - numba compiles it
    columns = blocks * GROUP
    size, step, chunks, parts = _shape(fmt)
    per = chunks // parts
    low, high = zeros16(), zeros16()
    for b in range(blocks):
        at, xa = (tile * blocks + b) * size, row * columns + b * GROUP
        for part in range(parts):
            al, ah, bl, bh = zeros16(), zeros16(), zeros16(), zeros16()  # low / high nibbles, outputs 0-15 / 16-31
            for c in range(part * per, part * per + per):
                a0, a1, b0, b1 = _chunk_words(fmt, weights, at + c * step)
                first, second = _columns(fmt, c)
                x_pair = pair(x, xa + first)
                al, ah = dot(al, a0, x_pair), dot(ah, a1, x_pair)
                x_pair = pair(x, xa + second)
                bl, bh = dot(bl, b0, x_pair), dot(bh, b1, x_pair)
            x_sum = sums[(row * blocks + b) * parts + part]
            low = _scaled(fmt, low, weights, at, 0, part, al, bl, x_sum)
            high = _scaled(fmt, high, weights, at, 1, part, ah, bh, x_sum)
    store_bf16(out, row * width + tile * TILE, low)
    store_bf16(out, row * width + tile * TILE + 16, high)


@helper
def _four_rows(fmt, x, sums, weights, tile, blocks, first, rows, out, width):  # pragma: no cover - numba compiles it
    """Rows first..first + 3 (those past `rows` repeat `first`: computed, not stored), each row's arithmetic
    `_one_row`'s."""
    columns = blocks * GROUP
    size, step, chunks, parts = _shape(fmt)
    per = chunks // parts
    r1 = first + 1 if first + 1 < rows else first
    r2 = first + 2 if first + 2 < rows else first
    r3 = first + 3 if first + 3 < rows else first
    low0, high0, low1, high1 = zeros16(), zeros16(), zeros16(), zeros16()
    low2, high2, low3, high3 = zeros16(), zeros16(), zeros16(), zeros16()
    for b in range(blocks):
        at = (tile * blocks + b) * size
        x0, x1, x2, x3 = first * columns + b * GROUP, r1 * columns + b * GROUP, r2 * columns + b * GROUP, \
            r3 * columns + b * GROUP
        for part in range(parts):
            al0, ah0, bl0, bh0 = zeros16(), zeros16(), zeros16(), zeros16()
            al1, ah1, bl1, bh1 = zeros16(), zeros16(), zeros16(), zeros16()
            al2, ah2, bl2, bh2 = zeros16(), zeros16(), zeros16(), zeros16()
            al3, ah3, bl3, bh3 = zeros16(), zeros16(), zeros16(), zeros16()
            for c in range(part * per, part * per + per):
                a0, a1, b0, b1 = _chunk_words(fmt, weights, at + c * step)
                one, two = _columns(fmt, c)
                x_pair = pair(x, x0 + one)
                al0, ah0 = dot(al0, a0, x_pair), dot(ah0, a1, x_pair)
                x_pair = pair(x, x1 + one)
                al1, ah1 = dot(al1, a0, x_pair), dot(ah1, a1, x_pair)
                x_pair = pair(x, x2 + one)
                al2, ah2 = dot(al2, a0, x_pair), dot(ah2, a1, x_pair)
                x_pair = pair(x, x3 + one)
                al3, ah3 = dot(al3, a0, x_pair), dot(ah3, a1, x_pair)
                x_pair = pair(x, x0 + two)
                bl0, bh0 = dot(bl0, b0, x_pair), dot(bh0, b1, x_pair)
                x_pair = pair(x, x1 + two)
                bl1, bh1 = dot(bl1, b0, x_pair), dot(bh1, b1, x_pair)
                x_pair = pair(x, x2 + two)
                bl2, bh2 = dot(bl2, b0, x_pair), dot(bh2, b1, x_pair)
                x_pair = pair(x, x3 + two)
                bl3, bh3 = dot(bl3, b0, x_pair), dot(bh3, b1, x_pair)
            s0, s1 = sums[(first * blocks + b) * parts + part], sums[(r1 * blocks + b) * parts + part]
            s2, s3 = sums[(r2 * blocks + b) * parts + part], sums[(r3 * blocks + b) * parts + part]
            low0, high0 = _scaled(fmt, low0, weights, at, 0, part, al0, bl0, s0), \
                _scaled(fmt, high0, weights, at, 1, part, ah0, bh0, s0)
            low1, high1 = _scaled(fmt, low1, weights, at, 0, part, al1, bl1, s1), \
                _scaled(fmt, high1, weights, at, 1, part, ah1, bh1, s1)
            low2, high2 = _scaled(fmt, low2, weights, at, 0, part, al2, bl2, s2), \
                _scaled(fmt, high2, weights, at, 1, part, ah2, bh2, s2)
            low3, high3 = _scaled(fmt, low3, weights, at, 0, part, al3, bl3, s3), \
                _scaled(fmt, high3, weights, at, 1, part, ah3, bh3, s3)
    store_tile_rows(out, first * width + tile * TILE, width, rows - first, low0, high0, low1, high1, low2, high2,
                    low3, high3)


@helper
def _two_rows(fmt, x, sums, weights, tile, blocks, first, out, width):  # pragma: no cover - numba compiles it
    """Rows first and first + 1, each row's arithmetic `_one_row`'s."""
    columns = blocks * GROUP
    size, step, chunks, parts = _shape(fmt)
    per = chunks // parts
    low0, high0, low1, high1 = zeros16(), zeros16(), zeros16(), zeros16()
    for b in range(blocks):
        at = (tile * blocks + b) * size
        x0, x1 = first * columns + b * GROUP, (first + 1) * columns + b * GROUP
        for part in range(parts):
            al0, ah0, bl0, bh0 = zeros16(), zeros16(), zeros16(), zeros16()
            al1, ah1, bl1, bh1 = zeros16(), zeros16(), zeros16(), zeros16()
            for c in range(part * per, part * per + per):
                a0, a1, b0, b1 = _chunk_words(fmt, weights, at + c * step)
                one, two = _columns(fmt, c)
                x_pair = pair(x, x0 + one)
                al0, ah0 = dot(al0, a0, x_pair), dot(ah0, a1, x_pair)
                x_pair = pair(x, x1 + one)
                al1, ah1 = dot(al1, a0, x_pair), dot(ah1, a1, x_pair)
                x_pair = pair(x, x0 + two)
                bl0, bh0 = dot(bl0, b0, x_pair), dot(bh0, b1, x_pair)
                x_pair = pair(x, x1 + two)
                bl1, bh1 = dot(bl1, b0, x_pair), dot(bh1, b1, x_pair)
            s0, s1 = sums[(first * blocks + b) * parts + part], sums[((first + 1) * blocks + b) * parts + part]
            low0, high0 = _scaled(fmt, low0, weights, at, 0, part, al0, bl0, s0), \
                _scaled(fmt, high0, weights, at, 1, part, ah0, bh0, s0)
            low1, high1 = _scaled(fmt, low1, weights, at, 0, part, al1, bl1, s1), \
                _scaled(fmt, high1, weights, at, 1, part, ah1, bh1, s1)
    at = first * width + tile * TILE
    store_bf16(out, at, low0)
    store_bf16(out, at + 16, high0)
    store_bf16(out, at + width, low1)
    store_bf16(out, at + width + 16, high1)


@callee
def rows_tiles(fmt, x, sums, weights, first_tile, end_tile, blocks, rows, out, width):  # pragma: no cover - numba
    """Tiles first_tile..end_tile - 1 (32 outputs each) of every row for the format `fmt` (a constant: compiled
    once per format): x and out bf16 pointers (out rows `width` apart), sums a pointer to the rows' sums per
    scale group (q4_kernel.block_sums; Q6_K: `half_sums`), weights a byte pointer to the layer's packed blocks
    (`pack`; tile t at t * blocks blocks)."""
    numba.literally(fmt)
    for tile in range(first_tile, end_tile):
        for first in range(0, rows, 4):
            if rows - first == 1:
                _one_row(fmt, x, sums, weights, tile, blocks, first, out, width)
            elif rows - first == 2:
                _two_rows(fmt, x, sums, weights, tile, blocks, first, out, width)
            else:
                _four_rows(fmt, x, sums, weights, tile, blocks, first, rows, out, width)


def _chunk_order(codes: np.ndarray, tiles: int, blocks: int, chunks: int) -> np.ndarray:
    """codes [tiles * 32, blocks * 32] as [tile, block, chunk, 64 bytes (q4_kernel.py's order), nibble]: Q8_0's
    chunk c the pair c (nibble: the byte's low and high four bits, same column), else pairs 2c and 2c + 1."""
    if chunks == 16:  # [tile, half, lane, i, block, c, col] -> [tile, block, c, lane, half, i, col]
        ordered = codes.reshape(tiles, 2, 4, 4, blocks, 16, 2).transpose(0, 4, 5, 2, 1, 3, 6)
        return np.stack([ordered & 15, ordered >> 4], axis=-1).reshape(tiles, blocks, 16, CHUNK, 2)
    ordered = codes.reshape(tiles, 2, 4, 4, blocks, 8, 2, 2).transpose(0, 4, 5, 2, 1, 3, 7, 6)
    return ordered.reshape(tiles, blocks, 8, CHUNK, 2)  # [..., col, parity]: parity 0 the low nibble's pair


def _per_tile(values: np.ndarray, tiles: int, dtype) -> np.ndarray:
    """[N, G] per-output values as [tile, G, 32] bytes of `dtype`, zero past N."""
    out = np.zeros((tiles * TILE, values.shape[1]), dtype)
    out[:values.shape[0]] = values
    return out.reshape(tiles, TILE, -1).transpose(0, 2, 1).copy().view(np.uint8)


def pack(kind: str, q: np.ndarray, d: np.ndarray, sc: np.ndarray | None = None) -> np.ndarray:
    """A layer's codes in this kernel's layout: uint8 [tiles, blocks, BLOCK_BYTES[fmt]]. q [N, K] uint8 codes
    (Q5_0 0..31, Q6_K 0..63, Q8_0 the int8 q + 128), d [N, K / 32] the fp16 d of each block (Q6_K: its
    super-block's), sc [N, K / 16] int8 (Q6_K): w = d sc (q - OFFSETS[fmt]). Raises ValueError where K is not
    whole blocks."""
    fmt = KINDS[kind]
    out_features, in_features = q.shape
    if in_features % GROUP or d.shape != (out_features, in_features // GROUP) or \
            (fmt == Q6_K) != (sc is not None) or (sc is not None and sc.shape != (out_features, in_features // 16)):
        raise ValueError(f"{kind} codes {q.shape}, d {d.shape}: the kernel takes blocks of {GROUP}")
    tiles, blocks = -(-out_features // TILE), in_features // GROUP
    padded = np.zeros((tiles * TILE, in_features), np.uint8)
    padded[:out_features] = q
    nibbles = _chunk_order(padded, tiles, blocks, 16 if fmt == Q8_0 else 8)
    chunks = [nibbles[..., 0] & 15 | (nibbles[..., 1] & 15) << 4]
    for parity in range(2 if _PLANES[fmt] else 0):  # the low nibbles' planes, then the high ones'
        for plane in range(_PLANES[fmt]):
            bits = (nibbles[..., parity] >> (4 + plane)) & 1
            chunks.append(np.packbits(bits, axis=-1, bitorder="little"))
    laid_out = [np.concatenate(chunks, axis=-1).reshape(tiles, blocks, -1)]
    if sc is not None:  # [N, blocks, 2] -> [tile, block, 2, 32]
        halves = _per_tile(sc.view(np.uint8).reshape(out_features, -1), tiles, np.uint8)
        laid_out.append(halves.reshape(tiles, blocks, 2, TILE).reshape(tiles, blocks, -1))
    laid_out.append(_per_tile(d.astype(np.float16), tiles, np.float16).reshape(tiles, blocks, -1))
    return np.ascontiguousarray(np.concatenate(laid_out, axis=-1))
