"""fp32 Linear layers on one to 64 rows, faster than oneDNN, with the bits oneDNN gives a row in a batch.

A one-row decode step of the default (SmolLM2 in fp32) reads 538 MB of weights; oneDNN's packed kernel
(kernels/layers/linear_kernels.py) streams them at 19 GB/s at one row where the box reads 33 GB/s, the small
matrices worst (13-17 GB/s: its few-row path is built for blocks of rows). This kernel computes one to
MAX_ROWS rows from a second copy of the weights laid out [N/32, K, 32], so each thread streams one
contiguous range, 32 outputs (two AVX-512 vectors) at a time, each weight vector loaded once for four rows
(a layer at four rows costs about what it costs at one). Past a few rows it is compute-bound, and still
ahead of oneDNN, whose kernel for a few dozen rows splits the work less evenly: SmolLM2's layer set at 16 /
32 / 48 / 64 rows 0.86 / 0.91-0.93 / 0.76-0.89 / 0.88-0.96x oneDNN's time, level from ~256 (and the 49,152-wide
lm_head level from 32); a 32-row decode step 0.92x. (Measured on a Zen 4 EPYC only.)

It must answer what oneDNN answers for the same row in a batch of any size (a row decoding alone gets the
bits it gets in company; more than MAX_ROWS rows go to oneDNN). oneDNN's fp32 kernel for several rows sums each output over K in blocks of B
columns, each block a chain of fused multiply-adds from zero in ascending k, the blocks' sums added in
order, then the bias (on a Zen 4 EPYC: B = 512 below 1,280 input features, 1,024 from there up). That is
what this kernel computes, for a block size found per layer at start-up by comparing its answer with
oneDNN's two-row one on random rows (`probe_block`): not assumed, since it is oneDNN's choice per CPU.
A layer where no candidate matches keeps oneDNN.

The copies of all layers share one mapping on transparent huge pages (kernels/cpu/huge_pages.py: a step 0.92-0.94x
its time on 4 KiB pages at one and four rows). The price is the copy: the packed weights are oneDNN's and
opaque. `option.row_kernel` (`auto`: where the copies take at most a quarter of the memory available; `on`;
`off`). Measured (benchmarks/journal/2026-11.md,
2-core EPYC): the default's one-row step 0.78x its time on oneDNN alone, served one-stream TPOT 20.9
against 35.2 ms.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import torch
from torch import nn

from lmi_serve.kernels.cpu import huge_pages
from lmi_serve.kernels.host import omp_threads, require_omp_layer
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.registry import max_rows

log = logging.getLogger(__name__)

POLICIES = ("auto", "on", "off")
TILE = 32  # outputs a thread computes together: two 16-lane vectors
# rows it takes (kernels/registry.py): a step 0.70x / 0.71x / 0.79x / 0.84x / 0.92x oneDNN's at 1 / 4 / 8 / 12 / 32 rows
MAX_ROWS = max_rows("row")
_BLOCKS = (512, 1024, 256, 2048, 128, 4096)  # candidate block sizes, the usual first; then "one block of all K"
_AUTO_SHARE = 0.25  # auto: the copies may take this share of the memory available at the swap

try:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from lmi_serve.kernels.cpu.numba_bits import FLOAT32x16, FLOATS16, float32_pointer, match_torch_threads, zeros16
except ImportError:  # pragma: no cover - a dependency; without it `kernel()` is None
    numba = None


if numba is not None:
    _I32 = ir.IntType(32)

    def _vector_pointer(builder, address, offset):
        return builder.bitcast(builder.gep(address, [offset]), FLOATS16.as_pointer())

    @intrinsic
    def _load16(typingctx, address, offset):
        """16 fp32 at address[offset]."""
        def codegen(context, builder, signature, args):
            return builder.load(_vector_pointer(builder, *args), align=4)
        return FLOAT32x16(address, offset), codegen

    @intrinsic
    def _store16(typingctx, address, offset, vector):
        def codegen(context, builder, signature, args):
            builder.store(args[2], _vector_pointer(builder, args[0], args[1]), align=4)
            return context.get_dummy_value()
        return types.void(address, offset, FLOAT32x16), codegen

    @intrinsic
    def _fma16(typingctx, total, weights, x):
        """total + weights * x (x a scalar, spread), each lane one fused multiply-add: one rounding."""
        def codegen(context, builder, signature, args):
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS16, [FLOATS16] * 3),
                                                 "llvm.fma.v16f32")
            spread = builder.insert_element(ir.Constant(FLOATS16, None), args[2], ir.Constant(_I32, 0))
            spread = builder.shuffle_vector(spread, spread, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            return builder.call(fma, [spread, args[1], args[0]])
        return FLOAT32x16(total, weights, types.float32), codegen

    @intrinsic
    def _add16(typingctx, a, b):
        return FLOAT32x16(a, b), lambda context, builder, signature, args: builder.fadd(args[0], args[1])


def _few_rows(x_address, rows, weights_address, tiles, columns, block, bias_address, out_address):  # pragma: no cover
    """out [rows, tiles * 32] = x [rows, columns] times the weights ([tiles, columns, 32], by address), oneDNN's
    order for each row: per block of `block` columns an fma chain from zero, the blocks' sums added in order,
    then the bias (bias_address 0: none). Rows go four at a time, each weight vector loaded once for the four
    (a group of fewer repeats its first row, computed and not stored); a lone row on its own loop. Every row's
    arithmetic is the same whichever way, so its bits do not depend on the others."""
    x, weights, out = float32_pointer(x_address), float32_pointer(weights_address), float32_pointer(out_address)
    for tile in numba.prange(tiles):
        rows_tile(x, rows, columns, weights, tiles, block, bias_address, tile, out)


@helper
def rows_tile(x, rows, columns, weights, tiles, block, bias_address, tile, out):  # pragma: no cover
    """One tile's 32 outputs of every row (`_few_rows`' loop body; kernels/cpu/layer_chain.py's too): x and out
    pointers or 1-D arrays, weights a pointer."""
    base, width = tile * columns * TILE, tiles * TILE
    for group in range(0, rows, 4):
        if rows - group == 1:
            _one_row_tile(x, group * columns, weights, base, columns, block, bias_address, tile, out, group * width)
        else:
            _four_rows_tile(x, group, rows, columns, weights, base, block, bias_address, tile, out, width)


@helper
def _one_row_tile(x, x_at, weights, base, columns, block, bias_address, tile, out, out_at):  # pragma: no cover
    low, high = zeros16(), zeros16()
    for first in range(0, columns, block):
        part_low, part_high = zeros16(), zeros16()
        for k in range(first, min(columns, first + block)):
            at, value = base + k * TILE, x[x_at + k]
            part_low = _fma16(part_low, _load16(weights, at), value)
            part_high = _fma16(part_high, _load16(weights, at + 16), value)
        if first == 0:
            low, high = part_low, part_high
        else:
            low, high = _add16(low, part_low), _add16(high, part_high)
    if bias_address != 0:
        bias = float32_pointer(bias_address)
        low, high = _add16(low, _load16(bias, tile * TILE)), _add16(high, _load16(bias, tile * TILE + 16))
    _store16(out, out_at + tile * TILE, low)
    _store16(out, out_at + tile * TILE + 16, high)


@helper
def _four_rows_tile(x, group, rows, columns, weights, base, block, bias_address, tile, out,
                    width):  # pragma: no cover
    # rows past the end read the group's first row: computed, never stored
    x0 = group * columns
    x1 = (group + 1) * columns if group + 1 < rows else x0
    x2 = (group + 2) * columns if group + 2 < rows else x0
    x3 = (group + 3) * columns if group + 3 < rows else x0
    low0, high0, low1, high1 = zeros16(), zeros16(), zeros16(), zeros16()
    low2, high2, low3, high3 = zeros16(), zeros16(), zeros16(), zeros16()
    for first in range(0, columns, block):
        part_low0, part_high0, part_low1, part_high1 = zeros16(), zeros16(), zeros16(), zeros16()
        part_low2, part_high2, part_low3, part_high3 = zeros16(), zeros16(), zeros16(), zeros16()
        for k in range(first, min(columns, first + block)):
            at = base + k * TILE
            w_low, w_high = _load16(weights, at), _load16(weights, at + 16)
            part_low0, part_high0 = _fma16(part_low0, w_low, x[x0 + k]), _fma16(part_high0, w_high, x[x0 + k])
            part_low1, part_high1 = _fma16(part_low1, w_low, x[x1 + k]), _fma16(part_high1, w_high, x[x1 + k])
            part_low2, part_high2 = _fma16(part_low2, w_low, x[x2 + k]), _fma16(part_high2, w_high, x[x2 + k])
            part_low3, part_high3 = _fma16(part_low3, w_low, x[x3 + k]), _fma16(part_high3, w_high, x[x3 + k])
        if first == 0:
            low0, high0, low1, high1 = part_low0, part_high0, part_low1, part_high1
            low2, high2, low3, high3 = part_low2, part_high2, part_low3, part_high3
        else:
            low0, high0 = _add16(low0, part_low0), _add16(high0, part_high0)
            low1, high1 = _add16(low1, part_low1), _add16(high1, part_high1)
            low2, high2 = _add16(low2, part_low2), _add16(high2, part_high2)
            low3, high3 = _add16(low3, part_low3), _add16(high3, part_high3)
    if bias_address != 0:
        bias = float32_pointer(bias_address)
        bias_low, bias_high = _load16(bias, tile * TILE), _load16(bias, tile * TILE + 16)
        low0, high0 = _add16(low0, bias_low), _add16(high0, bias_high)
        low1, high1 = _add16(low1, bias_low), _add16(high1, bias_high)
        low2, high2 = _add16(low2, bias_low), _add16(high2, bias_high)
        low3, high3 = _add16(low3, bias_low), _add16(high3, bias_high)
    at = group * width + tile * TILE
    _store16(out, at, low0)
    _store16(out, at + 16, high0)
    if group + 1 < rows:
        _store16(out, at + width, low1)
        _store16(out, at + width + 16, high1)
    if group + 2 < rows:
        _store16(out, at + 2 * width, low2)
        _store16(out, at + 2 * width + 16, high2)
    if group + 3 < rows:
        _store16(out, at + 3 * width, low3)
        _store16(out, at + 3 * width + 16, high3)


def _compile() -> Any:
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
    compiled = numba.njit(parallel=True, cache=True, nogil=True)(_few_rows)
    ones = RowWeights.pack(torch.ones(TILE + 1, 3), torch.ones(TILE + 1), 2)
    if not torch.equal(ones.compute(compiled, torch.ones(1, 3)), torch.full((1, TILE + 1), 4.0)):  # compiles it now
        raise RuntimeError("its self-check failed")
    require_omp_layer()
    return compiled


_compiled = CompiledOnce(_compile, "row kernel unavailable: fp32 Linear layers keep oneDNN for every row count")


def kernel() -> Any | None:
    """The compiled kernel, or None where numba or its OpenMP layer is missing (logged once)."""
    return _compiled.get()


class RowWeights:
    """A layer's weights [N, K] (and bias) laid out for the row kernel, with oneDNN's block size. Called on
    one to MAX_ROWS contiguous fp32 rows ([..., K]) it returns [..., N]; only where `kernel()` is not None."""

    def __init__(self, laid_out: torch.Tensor, bias: torch.Tensor | None, out_features: int, block: int):
        self.weights, self.bias = laid_out, bias  # [ceil(N / 32), K, 32] (rows past N zero); [ceil(N / 32) * 32]
        self.out_features, self.block = out_features, block
        self.tiles, self.in_features = laid_out.shape[:2]
        self.width = self.tiles * TILE
        # per call ~3 µs in the kernel's dispatch and threads' start: everything else is looked up once here
        self._weights_address = laid_out.data_ptr()
        self._bias_address = 0 if bias is None else bias.data_ptr()

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None, block: int,
             into: torch.Tensor | None = None) -> "RowWeights":
        """The copy of `weight` [N, K] laid out for the kernel (in `into`, `laid_out_size(N, K)` floats, where
        given), with `bias` padded alike."""
        out_features, in_features = weight.shape
        tiles = -(-out_features // TILE)
        padding = tiles * TILE - out_features  # zero rows only where the outputs are not whole tiles
        padded = weight.float() if not padding else torch.nn.functional.pad(weight.float(), (0, 0, 0, padding))
        source = padded.reshape(tiles, TILE, in_features).transpose(1, 2)
        laid_out = source.contiguous() if into is None else into.view(tiles, in_features, TILE).copy_(source)
        if bias is not None:
            bias = torch.cat([bias.detach().float(), torch.zeros(tiles * TILE - out_features)]).contiguous()
        return cls(laid_out, bias, out_features, block)

    def with_block(self, block: int) -> "RowWeights":
        """The same copy read with another block size."""
        return RowWeights(self.weights, self.bias, self.out_features, block)

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute(_compiled.value, x)

    def compute(self, compiled: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"the row kernel takes fp32 rows of {self.in_features}, not {x.dtype} {list(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty(*x.shape[:-1], self.width, dtype=torch.float32)
        match_torch_threads()
        compiled(x.data_ptr(), x.numel() // self.in_features, self._weights_address, self.tiles, self.in_features,
                 self.block, self._bias_address, out.data_ptr())
        return out if self.width == self.out_features else out[..., :self.out_features]


_COMPUTED_ON_THEIR_COPY: set[type] = set()  # see computes_rows_on_copy


def computes_rows_on_copy(cls: type) -> type:
    """Mark a Linear class whose forward of 1 to MAX_ROWS fp32 rows is its copy's answer (`_row_weights`, a
    RowWeights, or None), and nothing else: code that calls the copy directly (kernels/cpu/layer_chain.py) then
    gets the layer's bits. A class decorator (linear_kernels.OneDnnLinear)."""
    _COMPUTED_ON_THEIR_COPY.add(cls)
    return cls


def copy_of(module: nn.Module) -> "RowWeights | None":
    """`module`'s copy where its class computes few rows on it (computes_rows_on_copy) and it has one."""
    return module._row_weights if type(module) in _COMPUTED_ON_THEIR_COPY else None


def laid_out_size(out_features: int, in_features: int) -> int:
    """Floats a layer's copy takes (its outputs padded to whole tiles)."""
    return -(-out_features // TILE) * TILE * in_features


def probe_block(weight: torch.Tensor, bias: torch.Tensor | None, batched: Callable[[torch.Tensor], torch.Tensor],
                into: torch.Tensor | None = None) -> RowWeights | None:
    """The layer's weights for the row kernel (copied into `into` where given: `RowWeights.pack`) with the block
    size whose answers equal `batched`'s (the layer's kernel on two rows) for random rows, or None where no
    candidate does."""
    in_features = weight.shape[1]
    rows = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = batched(rows)  # two rows: oneDNN's kernel for a batch
    packed = RowWeights.pack(weight, bias, _BLOCKS[0], into)
    for block in dict.fromkeys(min(size, in_features) for size in (*_BLOCKS, in_features)):
        candidate = packed.with_block(block)
        if all(torch.equal(candidate(rows[i:i + 1])[0], want[i]) for i in range(2)):
            return candidate
    return None


@dataclass
class RowKernelReport:
    """What `use_row_kernel` did: for the start-up log."""

    policy: str
    layers: int = 0
    nbytes: int = 0
    why_not: str = ""  # when no layer got a copy: why
    unmatched: list[str] | None = None  # layers whose block size no candidate matched: oneDNN always

    def describe(self) -> str:
        if not self.layers:
            return f"option.row_kernel={self.policy}: not used ({self.why_not})"
        unmatched = f"; {len(self.unmatched)} kept on oneDNN (no block size matched)" if self.unmatched else ""
        return (f"option.row_kernel={self.policy}: {self.layers} fp32 Linear layers with a copy for 1-{MAX_ROWS} "
                f"rows ({self.nbytes / 2**20:.0f} MiB){unmatched}")


REPLICAS_ENV = "LMI_SERVE_REPLICAS"  # engine replicas loading side by side (server/cpu_replicas.py sets it)


def available_share() -> int:
    """This process's share of the memory available now: each of the REPLICAS_ENV replicas makes its own
    copies, so `auto` makes them where every replica's fit a quarter of it."""
    replicas = os.environ.get(REPLICAS_ENV, "1")
    return psutil.virtual_memory().available // max(1, int(replicas) if replicas.isdigit() else 1)


def use_row_kernel(layers: list[tuple[str, nn.Module]], policy: str,
                   available_bytes: int | None = None) -> RowKernelReport:
    """Give fp32 `layers` (name, linear_kernels.OneDnnLinear) their copy for the row kernel
    (`layer.use_row_kernel`) as `policy` says: `on` all, `off` none, `auto` all where the copies fit in a
    quarter of `available_bytes` (this replica's share of the memory available now when None). Raises ValueError for an unknown policy."""
    if policy not in POLICIES:
        raise ValueError(f"option.row_kernel: {policy!r} is not one of {', '.join(POLICIES)}")
    report = RowKernelReport(policy)
    sizes = [laid_out_size(module.out_features, module.in_features) for _, module in layers]
    need = 4 * sum(sizes)
    available = available_share() if available_bytes is None else available_bytes
    if policy == "off":
        report.why_not = "off"
    elif not layers:
        report.why_not = "no fp32 Linear layer on oneDNN"
    elif policy == "auto" and need > _AUTO_SHARE * available:
        report.why_not = (f"the copies would take {need / 2**30:.1f} GiB, more than a quarter of the "
                          f"{available / 2**30:.1f} GiB available; `on` forces them")
    elif kernel() is None:
        report.why_not = "numba or its OpenMP layer is missing"
    if report.why_not:
        return report
    report.unmatched = []
    arena, at = huge_pages.floats(sum(sizes)), 0  # every copy in one mapping on huge pages (huge_pages.py)
    for (name, module), size in zip(layers, sizes):
        weights = probe_block(module.dense_weight(), module.bias, module.batched, arena[at:at + size])
        at += size
        if weights is None:
            report.unmatched.append(name)
            continue
        module.use_row_kernel(weights)
        report.layers += 1
        report.nbytes += weights.nbytes
    if report.unmatched:
        log.info("row kernel: no block size gives oneDNN's bits for %s: they keep oneDNN for every row count",
                 ", ".join(report.unmatched))
    return report
