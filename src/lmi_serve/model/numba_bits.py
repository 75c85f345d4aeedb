"""Scalar helpers the numba kernels share (model/vnni_matmul.py, model/norm_kernel.py, engine/kv/decode_kernel.py):
a torch tensor's address as a typed pointer, fp32 <-> its bits, and bf16 read and written as its 16 bits (numba
has no bf16).

`NUMBA` is False where numba is not installed; the kernels then say they are unavailable and nothing here
is defined but `helper`, which leaves a function as plain Python.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - a dependency; without it the kernels are unavailable
    numba = None

NUMBA = numba is not None


def helper(function):
    """A numba function a kernel calls (compiled with it, lazily, inlined); plain Python where numba is missing."""
    return numba.njit(cache=True, inline="always")(function) if numba is not None else function


if numba is not None:
    _I32 = ir.IntType(32)

    def _pointer_to(element: ir.Type, element_type: types.Type):
        """An intrinsic that reads an integer address (a torch tensor's data_ptr()) as a pointer to `element`:
        no numpy view made per call (~1 µs each)."""
        @intrinsic
        def pointer(typingctx, address):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], element.as_pointer())
            return types.CPointer(element_type)(address), codegen
        return pointer

    bf16_pointer = _pointer_to(ir.IntType(16), types.uint16)  # bf16 (or fp16) as its bits
    float32_pointer = _pointer_to(ir.FloatType(), types.float32)
    byte_pointer = _pointer_to(ir.IntType(8), types.uint8)  # a bool tensor's bytes

    @intrinsic
    def float_bits(typingctx, value):
        return types.uint32(value), lambda context, builder, signature, args: builder.bitcast(args[0], _I32)

    @intrinsic
    def bits_float(typingctx, bits):
        """The fp32 whose bits are the low 32 of the integer `bits` (numba widens shifted integers)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], _I32)
            return builder.bitcast(low, ir.FloatType())
        return types.float32(bits), codegen


@helper
def widen(bits):  # pragma: no cover - numba compiles it
    """bf16 bits (uint16) -> the fp32 they are the top half of (exact)."""
    return bits_float(np.uint32(bits) << 16)


@helper
def bf16(value):  # pragma: no cover - numba compiles it
    """fp32 -> bf16 bits, rounded to nearest even (torch's rounding); NaN stays NaN."""
    bits = float_bits(value)
    if value != value:
        return np.uint16((bits >> 16) | 0x40)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
