"""A layer's few bf16 rows times GGUF blocks of several formats at once: Q4_0 / Q4_1 / Q4_K (q4_kernel.py),
Q5_0, Q6_K and Q8_0 (wide_kernel.py), each part of the outputs in its own.

llama-quantize's Q4_K_M of a model whose widths are not multiples of 256 (SmolLM2-135M: 576) holds most layers
in Q5_0, ffn_down in Q4_K or Q6_K and some attn_v in Q8_0; stacked q/k/v then mix formats. `BlockWeights` is
such a layer: parts along the outputs, each whole tiles of 32 outputs (the last may be padded), described by a
table of (format, first tile, address, tiles, bytes a tile). One parallel loop gives each thread a contiguous
share of the tiles of about equal bytes, and runs each part of its share on the part's format's tile function
(compiled apart, once per format: numba_bits.callee): one call for q, k and v whatever their formats. A tile's
arithmetic is its format's alone, whichever thread runs it, so a stacked layer's slices are the separate
layers' outputs bit for bit, and a row's output does not depend on the batch. kernels/cpu/q4_chain.py calls
`matmul` inside its layer calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmi_serve.kernels.cpu import q4_kernel, wide_kernel
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.cpu.wide_kernel import Q5_0, Q6_K, Q8_0
from lmi_serve.kernels.host import cpu_has, omp_threads, require_omp_layer
from lmi_serve.kernels.registry import KERNELS

Q4 = 0  # q4_kernel.py's layout (Q4_0, Q4_1, Q4_K)
GROUP, TILE = q4_kernel.GROUP, q4_kernel.TILE
BLOCK_BYTES = {Q4: q4_kernel.BLOCK_BYTES, **wide_kernel.BLOCK_BYTES}
NAMES = {Q4: "Q4", Q5_0: "Q5_0", Q6_K: "Q6_K", Q8_0: "Q8_0"}
_FIELDS = 5  # a table row: format, first tile, the part's address less its first tile's offset, tiles, bytes a tile

try:
    import numba

    from lmi_serve.kernels.cpu.numba_bits import bf16_pointer, byte_pointer, float32_pointer, held, int64_pointer
    from lmi_serve.kernels.cpu.numba_bits import match_torch_threads
except ImportError:  # pragma: no cover - a dependency; without it `kernel()` is None
    numba = None


@helper
def _share(x, sums, sums16, table, parts, first_tile, end_tile, blocks, rows, out, width):  # pragma: no cover
    """Tiles first_tile..end_tile - 1 of every row, each part's run by its format's tile function (one call
    a part: `fmt` a constant in each)."""
    for p in range(parts):
        fmt, weights = table[_FIELDS * p], byte_pointer(table[_FIELDS * p + 2])
        start = max(first_tile, table[_FIELDS * p + 1])
        end = min(end_tile, table[_FIELDS * p + 1] + table[_FIELDS * p + 3])
        if start >= end:
            continue
        if fmt == Q4:
            q4_kernel.rows_tiles(x, sums, weights, start, end, blocks, rows, out, width)
        elif fmt == Q5_0:
            wide_kernel.rows_tiles(Q5_0, x, sums, weights, start, end, blocks, rows, out, width)
        elif fmt == Q6_K:
            wide_kernel.rows_tiles(Q6_K, x, sums16, weights, start, end, blocks, rows, out, width)
        else:
            wide_kernel.rows_tiles(Q8_0, x, sums, weights, start, end, blocks, rows, out, width)


@helper
def _split(table, parts, thread, threads):  # pragma: no cover - numba compiles it
    """The first tile of `thread`'s share: the tiles cut into `threads` runs of about equal bytes (a Q8_0 tile
    reads 1.5x a Q5_0 one: counted in tiles, a q/k/v of both would leave one thread a fifth more to read)."""
    total = 0
    for p in range(parts):
        total += table[_FIELDS * p + 3] * table[_FIELDS * p + 4]
    wanted, at = total * thread // threads, 0
    for p in range(parts):
        size = table[_FIELDS * p + 3] * table[_FIELDS * p + 4]
        if at + size >= wanted:
            return table[_FIELDS * p + 1] + -(-(wanted - at) // table[_FIELDS * p + 4])
        at += size
    return table[_FIELDS * (parts - 1) + 1] + table[_FIELDS * (parts - 1) + 3]


@helper
def matmul(x, rows, table, parts, tiles, blocks, out, threads):  # pragma: no cover - numba compiles it
    """out [rows, tiles * 32] = x [rows, blocks * 32] times the table's parts (bf16 pointers; table an int64
    pointer to `parts` rows of BlockWeights.table), in `threads` shares."""
    columns, per32, per16 = blocks * GROUP, 0, 0
    for p in range(parts):
        if table[_FIELDS * p] == Q6_K:
            per16 = 1
        else:
            per32 = 1
    sums = np.empty(rows * blocks * (per32 + 2 * per16), dtype=np.float32)  # those a part's format reads
    if per32:
        q4_kernel.block_sums(x, rows, columns, sums)
    if per16:
        wide_kernel.half_sums(x, rows, columns, sums[rows * blocks * per32:])
    # addresses: an array argument would be counted (an atomic, from both threads) on each call
    at, at16 = float32_pointer(sums.ctypes.data), float32_pointer(sums.ctypes.data + 4 * rows * blocks * per32)
    for thread in numba.prange(threads):  # a contiguous share of the tiles each, of about equal bytes
        _share(x, at, at16, table, parts, _split(table, parts, thread, threads),
               _split(table, parts, thread + 1, threads), blocks, rows, out, tiles * TILE)
    held(sums)


def _block_rows(x_address, rows, table_address, parts, tiles, blocks, out_address, threads):  # pragma: no cover
    matmul(bf16_pointer(x_address), rows, int64_pointer(table_address), parts, tiles, blocks,
           bf16_pointer(out_address), threads)


class BlockWeights:
    """A layer's parts (`parts`: (format, packed uint8 [tiles, blocks, BLOCK_BYTES[format]], outputs) in output
    order, every part but the last filling its tiles); called on contiguous bf16 rows [M, K] it returns [M, N]
    bf16. The packed tensors are held here: the table holds their addresses."""

    def __init__(self, parts: list[tuple[int, torch.Tensor, int]]):
        blocks = {packed.shape[1] for _, packed, _ in parts}
        if len(blocks) != 1 or any(packed.shape[2] != BLOCK_BYTES[fmt] for fmt, packed, _ in parts):
            raise ValueError("the parts must have the same input width and their formats' block bytes")
        if any(packed.shape[0] * TILE != outputs for _, packed, outputs in parts[:-1]):
            raise ValueError(f"every part but the last must fill whole tiles of {TILE} outputs")
        self.blocks = blocks.pop()
        self.formats = [NAMES[fmt] for fmt, _, _ in parts]
        self._packed = [packed.contiguous() for _, packed, _ in parts]
        rows, first = [], 0
        for (fmt, _, _), packed in zip(parts, self._packed):
            shifted = packed.data_ptr() - first * self.blocks * BLOCK_BYTES[fmt]  # tile t's blocks at t * blocks
            rows.append((fmt, first, shifted, packed.shape[0], self.blocks * BLOCK_BYTES[fmt]))
            first += packed.shape[0]
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.parts, self.tiles = len(rows), first
        self.in_features, self.width = self.blocks * GROUP, self.tiles * TILE
        self.out_features = sum(outputs for _, _, outputs in parts)
        self.nbytes = sum(packed.nbytes for packed in self._packed) + self.table.nbytes

    @classmethod
    def of_q4(cls, weights: q4_kernel.Q4Weights) -> "BlockWeights":
        """One Q4 part: a Q4Linear's weights as `matmul` takes them (q4_chain.py)."""
        return cls([(Q4, weights.packed, weights.out_features)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _call(_compiled.value, self, x)


def _call(compiled: Any, weights: BlockWeights, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    if x.dtype != torch.bfloat16 or len(shape) != 2 or shape[1] != weights.in_features or not shape[0] \
            or not x.is_contiguous():
        raise ValueError(f"the block kernel takes contiguous bf16 rows of {weights.in_features}, not {x.dtype} "
                         f"{list(shape)}")
    out = torch.empty((shape[0], weights.width), dtype=torch.bfloat16)
    compiled(x.data_ptr(), shape[0], weights.table.data_ptr(), weights.parts, weights.tiles, weights.blocks,
             out.data_ptr(), match_torch_threads())
    return out if weights.width == weights.out_features else out[:, :weights.out_features]


def dequantized(kind: str, q: np.ndarray, d: np.ndarray, sc: np.ndarray | None = None) -> np.ndarray:
    """The fp64 weights [N, K] of wide_kernel.pack's arguments: d sc (q - offset)."""
    scale = np.repeat(d.astype(np.float64), GROUP, axis=1)
    if sc is not None:
        scale = scale * np.repeat(sc.astype(np.float64), 16, axis=1)
    return scale * (q.astype(np.float64) - wide_kernel.OFFSETS[wide_kernel.KINDS[kind]])


def _self_check(compiled: Any) -> None:
    """Every format, stacked as parts of one layer (a Q4 part too), against fp64 of the same weights."""
    rng = np.random.default_rng(0)
    rows, columns = 5, 256
    parts, reference = [], []
    for kind, bits, outputs in (("Q5_0", 5, 32), ("Q6_K", 6, 64), ("Q8_0", 8, 32)):
        q = rng.integers(0, 1 << bits, (outputs, columns)).astype(np.uint8)
        d = np.repeat(rng.uniform(1e-3, 1e-2, (outputs, columns // 256)), 8, axis=1).astype(np.float16)
        sc = rng.integers(-128, 128, (outputs, columns // 16)).astype(np.int8) if kind == "Q6_K" else None
        packed = wide_kernel.pack(kind, q, d.astype(np.float32), sc)
        parts.append((wide_kernel.KINDS[kind], torch.from_numpy(packed), outputs))
        reference.append(dequantized(kind, q, d, sc))
    scale = rng.uniform(0.001, 0.01, (40, columns // GROUP)).astype(np.float16).astype(np.float32)
    q4 = q4_kernel.pack(rng.integers(0, 16, (40, columns)).astype(np.uint8), scale, 8 * scale)
    parts.append((Q4, q4.packed, 40))
    reference.append(q4_kernel.unpacked(q4))
    weights = BlockWeights(parts)
    x = torch.randn(rows, columns).to(torch.bfloat16)
    got = _call(compiled, weights, x).double()
    want = x.double() @ torch.from_numpy(np.concatenate(reference)).double().T
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()):
        raise RuntimeError(f"its self-check failed (max difference {(got - want).abs().max().item()})")


def _compile() -> Any:
    if not cpu_has(*KERNELS["block_bf16"].cpu_features):
        raise RuntimeError("the CPU has no AVX-512 BF16")
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
    compiled = numba.njit(parallel=True, cache=True, nogil=True)(_block_rows)
    _self_check(compiled)  # compiles it now (start-up)
    require_omp_layer()
    return compiled


_compiled = CompiledOnce(_compile, "block kernel unavailable: Q5_0 / Q6_K layers keep the VNNI kernel or their "
                                   "loaded weights")


def kernel() -> Any | None:
    """The compiled kernel, or None where numba, its OpenMP layer or AVX-512 BF16 is missing (logged once)."""
    return _compiled.get()
