"""A GGUF's Q8_0 weights times int16 activations on AVX-512 VNNI, for a few rows (kernels/layers/gguf_linears.py).

A one-row decode step of the q4-bf16 opt-in reads SmolLM2's tied lm_head (49,152 x 576, Q8_0 in its GGUF)
as a bf16 copy: 57 MB, 1.3 ms at this box's ~47 GB/s, 15 % of the step. The GGUF's own blocks are 30 MB.
This kernel reads them as they are: each row of activations is rounded to int16 per 32 columns (scale =
max |x| / 32767, to nearest: ~15 bits against the bf16 input's 8), and a block's 32 weights (int8,
sign-extended) times its 32 activations are one `vpdpwssd` (16 int32 lanes of two products), scaled by
d (the block's fp16 scale) times the activations' scale in fp32:

    sum_k w[n, k] x[k]  ~=  sum_blocks d[n, b] da[b] sum_j q[n, j] qa[j]

exact up to the int16 rounding (a dot product of one block is exact in int32 and in its fp32 cast), fp32
summation order and the bf16 output's rounding. Each row is computed on its own, so its result depends on
that row alone, never on the batch.

Measured on a Zen 5 EPYC (2 cores; benchmarks/journal/2026-11.md): the lm_head at one row 0.4-0.5 ms warm against
its bf16 oneDNN copy's 0.9, a whole q4-bf16 step ~0.7 ms shorter. (An int4 variant for the Q4 layers,
int8 activations as llama.cpp's, ran 1.8-1.9 against torch's int4 kernel's 2.4-2.5 ms for SmolLM2's 120
calls back to back, but level or slower inside a step and +1.8 % decode perplexity: not kept.)

Where numba, its OpenMP layer or the CPU's VNNI is missing, `kernel()` is None and Q8_0 layers keep
their loaded weights; compiled once per machine, cached by numba.

Layout (`pack`): q [N, K] int8 (the GGUF's), d [N, K/32] as fp16 bits (uint16). K % 32 == 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmi_serve.kernels.host import cpu_has, omp_threads, require_omp_layer
from lmi_serve.kernels.cpu.numba_bits import CompiledOnce, helper
from lmi_serve.kernels.registry import KERNELS


GROUP = 32  # columns per scale (a GGUF Q8_0 block)
_INT16_MAX = 32767

try:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from lmi_serve.kernels.cpu.numba_bits import (FLOAT32x16, Vector, bf16, bf16_pointer, bits_float, match_torch_threads,
                                            zeros16)
except ImportError:  # pragma: no cover - a dependency; without it `kernel()` is None
    numba = None


def pack(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8Blocks' (q int8 [N, K], scale [N, K/32]) as this kernel's (q, d as fp16 bits)."""
    if q.shape[1] % GROUP or scale.shape != (q.shape[0], q.shape[1] // GROUP):
        raise ValueError(f"q {q.shape} and scale {scale.shape}: the kernel takes blocks of {GROUP} columns")
    return np.ascontiguousarray(q, dtype=np.int8), scale.astype(np.float16).view(np.uint16)


def unpacked(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The fp32 weights [N, K] a packed layer holds (for tests and checks)."""
    return q.astype(np.float32) * np.repeat(d.view(np.float16).astype(np.float32), GROUP, axis=1)


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int16 activations and their per-block scales for fp32 rows `x` [M, K] (for tests)."""
    blocks = x.reshape(x.shape[0], -1, GROUP).astype(np.float32)
    scale = np.abs(blocks).max(axis=-1) / np.float32(_INT16_MAX)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    return np.rint(blocks * inverse[..., None]).astype(np.int16).reshape(x.shape), scale.astype(np.float32)


if numba is not None:
    _SHORTS32, _INT32x16 = Vector("i16", 32), Vector("i32", 16)

    _I32 = ir.IntType(32)
    # a multiply and add may fuse, but no reassociation: a row's sums keep one order at any row count
    _CONTRACT = ("contract",)

    def _address(context, builder, array_type, array, offset, element):
        data = context.make_array(array_type)(context, builder, array).data
        return builder.bitcast(builder.gep(data, [offset]), element.as_pointer())

    @intrinsic
    def _weights32(typingctx, q, offset):
        """A block's 32 int8 weights at q[offset], sign-extended to int16."""
        def codegen(context, builder, signature, args):
            raw = builder.load(_address(context, builder, signature.args[0], *args, ir.VectorType(ir.IntType(8), 32)),
                               align=1)
            return builder.sext(raw, ir.VectorType(ir.IntType(16), 32))
        return _SHORTS32(q, offset), codegen

    @intrinsic
    def _activations32(typingctx, quantized, offset):
        def codegen(context, builder, signature, args):
            return builder.load(_address(context, builder, signature.args[0], *args, ir.VectorType(ir.IntType(16), 32)),
                                align=2)
        return _SHORTS32(quantized, offset), codegen

    @intrinsic
    def _scaled_dot(typingctx, total, weights, activations, scale):
        """total + float(vpdpwssd(weights, activations)) * scale: one block's 32 products in 16 lanes."""
        def codegen(context, builder, signature, args):
            lanes = ir.VectorType(_I32, 16)
            dot_function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                          "llvm.x86.avx512.vpdpwssd.512")
            dot = builder.call(dot_function, [ir.Constant(lanes, None), builder.bitcast(args[1], lanes),
                                              builder.bitcast(args[2], lanes)])
            floats = ir.VectorType(ir.FloatType(), 16)
            spread = builder.insert_element(ir.Constant(floats, None), args[3], ir.Constant(_I32, 0))
            spread = builder.shuffle_vector(spread, spread, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            product = builder.fmul(builder.sitofp(dot, floats), spread, flags=_CONTRACT)
            return builder.fadd(args[0], product, flags=_CONTRACT)
        return FLOAT32x16(total, weights, activations, types.float32), codegen

    @intrinsic
    def _sum(typingctx, vector):
        """The lanes' sum as a fixed tree (halves added to halves): the same bits wherever it is used."""
        def codegen(context, builder, signature, args):
            value, lanes = args[0], signature.args[0].lanes
            while lanes > 1:
                lanes //= 2
                low = builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(_I32, lanes), list(range(lanes))))
                high = builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(_I32, lanes),
                                                                        list(range(lanes, 2 * lanes))))
                value = builder.fadd(low, high)
            return builder.extract_element(value, ir.Constant(_I32, 0))
        return types.float32(vector), codegen

    @intrinsic
    def _half(typingctx, bits):
        """fp16 bits (uint16) as fp32."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(bits), codegen


@helper
def _quantize(x, quantized, scales):  # pragma: no cover - numba compiles it
    """bf16 rows x (bits) -> int16 per 32 columns and the blocks' scales."""
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // GROUP):
            largest = np.float32(0.0)
            for j in range(GROUP):
                largest = max(largest, abs(bits_float(np.uint32(x[r, b * GROUP + j]) << 16)))
            scale = largest / np.float32(_INT16_MAX)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            for j in range(GROUP):
                quantized[r, b * GROUP + j] = np.int16(np.rint(bits_float(np.uint32(x[r, b * GROUP + j]) << 16)
                                                               * inverse))
            scales[r, b] = scale


def _matmul(x_address, rows, q, d, out_address):  # pragma: no cover - numba compiles it
    """out [M, N] = x [M, K] times the packed weights' transpose, both bf16 and contiguous, given by address.
    Each row on its own (layers call it with one or two rows: Q8_MAX_ROWS), its weights' row read once
    from memory for all of them."""
    columns = q.shape[1]
    x = numba.carray(bf16_pointer(x_address), (rows, columns))
    out = numba.carray(bf16_pointer(out_address), (rows, q.shape[0]))
    quantized = np.empty((rows, columns), dtype=np.int16)
    scales = np.empty((rows, columns // GROUP), dtype=np.float32)
    _quantize(x, quantized, scales)
    for n in numba.prange(q.shape[0]):
        q_row, d_row = q[n], d[n]
        for r in range(rows):
            total = zeros16()
            for b in range(columns // GROUP):
                total = _scaled_dot(total, _weights32(q_row, GROUP * b), _activations32(quantized[r], GROUP * b),
                                    _half(d_row[b]) * scales[r, b])
            out[r, n] = bf16(_sum(total))


def _compile() -> Any:
    if not cpu_has(*KERNELS["q8_vnni"].cpu_features):
        raise RuntimeError("the CPU has no AVX-512 VNNI")
    omp_threads()  # numba with its OpenMP layer (kernels/host.py says why)
    compiled = numba.njit(parallel=True, cache=True, nogil=True)(_matmul)
    # compile now (start-up) and check the result against numpy's reading of the same arithmetic
    rng = np.random.default_rng(0)
    packed = pack(rng.integers(-127, 128, (16, 128)).astype(np.int8), rng.uniform(0.01, 0.1, (16, 4)))
    x = torch.randn(5, 128).to(torch.bfloat16)
    quantized, scales = quantized_rows(x.float().numpy())
    got = _call(compiled, x, *packed).float().numpy()
    want = (quantized.astype(np.float32) * np.repeat(scales, GROUP, axis=1)) @ unpacked(*packed).T
    if not np.allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max()):
        raise RuntimeError(f"its self-check failed (max difference {np.abs(got - want).max()})")
    require_omp_layer()
    return compiled


def _call(compiled: Any, x: torch.Tensor, q: np.ndarray, d: np.ndarray) -> torch.Tensor:
    # the kernel reads x by its address: its layout is checked here, ~0.3 µs
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != q.shape[1] or not x.is_contiguous():
        raise ValueError(f"the VNNI kernel takes contiguous bf16 [M, {q.shape[1]}], not {x.dtype} {list(x.shape)}")
    out = torch.empty((x.shape[0], q.shape[0]), dtype=torch.bfloat16)
    match_torch_threads()
    compiled(x.data_ptr(), x.shape[0], q, d, out.data_ptr())
    return out


_compiled = CompiledOnce(_compile, "VNNI kernel unavailable: Q8_0 layers keep their loaded weights")


def kernel() -> Any | None:
    """The compiled kernel, or None where numba, its OpenMP layer or VNNI is missing (logged once)."""
    return _compiled.get()


def matmul(x: torch.Tensor, q: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) times the packed layer's weights transposed: [M, N] bf16. Call only
    where `kernel()` is not None (compiled here on a first call that comes before it)."""
    return _call(_compiled.value if _compiled.done else kernel(), x, q, d)
