"""Helpers the numba kernels share (kernels/cpu/vnni_matmul.py, kernels/cpu/row_kernel.py, kernels/cpu/norm_kernel.py,
kernels/cpu/decode_kernel.py): a torch tensor's address as a typed pointer, fp32 <-> its bits, bf16 read and
written as its 16 bits (numba has no bf16), LLVM vectors as numba values (16 fp32 loaded, stored, summed, multiplied),
a prefetch hint, and numba's thread count kept at torch's.

`NUMBA` is False where numba is not installed; the kernels then say they are unavailable and nothing here
is defined but `helper`, which leaves a function as plain Python.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any, Callable

import numpy as np
import torch

try:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, models, register_model
except ImportError:  # pragma: no cover - a dependency; without it the kernels are unavailable
    numba = None

NUMBA = numba is not None
log = logging.getLogger(__name__)
if NUMBA:
    # numba's own pedantic SSA check ("not in scope", "please report") fires where an inlined overload is used in
    # two loops of one function (rotary_kernel.py's halves); the code it compiles is right (each kernel checks its
    # results against torch's at compile) and the warning would only reach the server's log at start-up.
    warnings.filterwarnings("ignore", category=numba.core.errors.NumbaIRAssumptionWarning)


def helper(function):
    """A numba function a kernel calls (compiled with it, lazily, inlined); plain Python where numba is missing."""
    return numba.njit(cache=True, inline="always")(function) if numba is not None else function


def callee(function):
    """A numba function kernels call without inlining it: compiled once (per literal argument where it asks
    with `numba.literally`) and cached, however many kernels call it. Numba copies an inlined function's IR
    into each caller, which for a tile function of a few hundred lines costs tens of seconds of compiling
    per copy; a call per tile of 32 outputs costs nothing measurable."""
    return numba.njit(cache=True, nogil=True)(function) if numba is not None else function


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
    int64_pointer = _pointer_to(ir.IntType(64), types.int64)

    @intrinsic
    def held(typingctx, array):
        """Nothing: a use of `array` that keeps it alive to here, where a kernel reads it by an address (numba frees
        an array after its last use, and an address is not one)."""
        return types.void(array), lambda context, builder, signature, args: context.get_dummy_value()

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

    class Vector(types.Type):
        """An LLVM vector value in numba code (`element` i16, i32 or f32): only intrinsics make or take one."""

        def __init__(self, element: str, lanes: int):
            self.element, self.lanes = element, lanes
            super().__init__(name=f"vector_{element}x{lanes}")

    _ELEMENTS = {"i16": ir.IntType(16), "i32": ir.IntType(32), "f32": ir.FloatType()}
    FLOAT32x16 = Vector("f32", 16)
    FLOATS16 = ir.VectorType(ir.FloatType(), 16)

    @register_model(Vector)
    class _VectorModel(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            super().__init__(dmm, fe_type, ir.VectorType(_ELEMENTS[fe_type.element], fe_type.lanes))

    @intrinsic
    def zeros16(typingctx):
        """16 fp32 zeros."""
        return FLOAT32x16(), lambda context, builder, signature, args: ir.Constant(FLOATS16, None)

    @intrinsic
    def load16(typingctx, pointer, offset):
        """16 fp32 at a pointer's element `offset`: read as they are (an fp32 pointer), or bf16 bits (a uint16
        pointer) widened exactly."""
        bits = pointer.dtype == types.uint16

        def codegen(context, builder, signature, args):
            at = builder.gep(args[0], [args[1]])
            if not bits:
                return builder.load(builder.bitcast(at, FLOATS16.as_pointer()), align=4)
            words = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
            lanes = ir.VectorType(_I32, 16)
            return builder.bitcast(builder.shl(builder.zext(words, lanes), ir.Constant(lanes, [16] * 16)), FLOATS16)
        return FLOAT32x16(pointer, offset), codegen

    @intrinsic
    def store16(typingctx, pointer, offset, vector):
        """16 fp32 at an fp32 pointer's element `offset`."""
        def codegen(context, builder, signature, args):
            builder.store(args[2], builder.bitcast(builder.gep(args[0], [args[1]]), FLOATS16.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(pointer, offset, FLOAT32x16), codegen

    @intrinsic
    def prefetch(typingctx, pointer, offset):
        """A hint to fetch the cache line of a pointer's element `offset` (for reading, kept in every cache level)."""
        def codegen(context, builder, signature, args):
            byte = ir.IntType(8).as_pointer()
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte, _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            at = builder.bitcast(builder.gep(args[0], [args[1]]), byte)
            builder.call(function, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
            return context.get_dummy_value()
        return types.void(pointer, offset), codegen

    @intrinsic
    def sum16(typingctx, vector):
        """The sum of 16 fp32 lanes, as a tree (LLVM's reduction with reassociation allowed)."""
        def codegen(context, builder, signature, args):
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), FLOATS16]),
                "llvm.vector.reduce.fadd.v16f32")
            return builder.call(function, [ir.Constant(ir.FloatType(), 0.0), args[0]],
                                fastmath=("reassoc", "nsz"))
        return types.float32(FLOAT32x16), codegen

    @intrinsic
    def times16(typingctx, vector, scalar):
        """16 fp32 lanes each times one fp32 scalar."""
        def codegen(context, builder, signature, args):
            one = builder.insert_element(ir.Constant(FLOATS16, None), args[1], ir.Constant(_I32, 0))
            spread = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            return builder.fmul(args[0], spread)
        return FLOAT32x16(vector, types.float32), codegen


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


_threads = threading.local()  # numba's thread count is per calling thread


def match_torch_threads() -> int:
    """Run the calling thread's next parallel kernel on torch's thread count (set only when it changed: ~1 µs);
    returns the count set (a kernel that splits its work per thread takes it as an argument: reading it inside
    compiled code would keep numba from caching the kernel)."""
    threads = torch.get_num_threads()
    if getattr(_threads, "count", None) != threads:
        _threads.numba = min(threads, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(_threads.numba)
        _threads.count = threads
    return _threads.numba


class CompiledOnce:
    """A kernel compiled on its first use, once, under a lock: `get()` returns it, or None where compiling
    raised (logged once at `level`, after `unavailable`: what runs instead). `value` reads it without the lock
    once compiled (kernels called many times a step); `error` says why compiling failed, where it did."""

    def __init__(self, compile: Callable[[], Any], unavailable: str, level: int = logging.INFO):
        self._compile, self._unavailable, self._level = compile, unavailable, level
        self._lock = threading.Lock()
        self.done, self.value, self.error = False, None, None

    def get(self) -> Any | None:
        if not self.done:
            with self._lock:
                if not self.done:
                    try:
                        if numba is None:
                            raise RuntimeError("numba is not installed")
                        self.value = self._compile()
                    except Exception as error:  # noqa: BLE001 - any failure means the fallback, said once
                        self.error = f"{type(error).__name__}: {error}"
                        log.log(self._level, "%s: %s", self._unavailable, error)
                    self.done = True
        return self.value
