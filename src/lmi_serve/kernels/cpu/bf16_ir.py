"""LLVM IR pieces of the bf16 block kernels (q4_kernel.py, wide_kernel.py): weight codes made bf16 words by bit
tricks, `vdpbf16ps`, fp16 scales read as fp32, fp32 rounded to bf16. Intrinsics only: nothing here compiles alone.

A code q below 128 becomes the bf16 word 0x43 << 8 | q, which is exactly 128 + q (bf16 steps by 1 between 128
and 256): no integer-to-float conversion. A chunk is 64 bytes of nibbles (q4_kernel.py's docstring gives their
order); a wider code adds its high bits as bit planes, 64 bits a plane (bit i the byte i's), each expanded by
one masked select (`words`). The interleave with 0x43 (`vpunpck[lh]bw`) puts the words in the order the
16 fp32 lanes of `vdpbf16ps` take them: two columns (a pair) of 16 outputs.
"""

from __future__ import annotations

try:
    import numba
    from llvmlite import ir
    from llvmlite.ir.types import _BaseFloatType
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from lmi_serve.kernels.cpu.numba_bits import FLOAT32x16, FLOATS16, Vector
except ImportError:  # pragma: no cover - a dependency; without it the kernels are unavailable
    numba = None

CHUNK = 64  # bytes of nibbles a chunk: 128 codes, two column pairs of 32 outputs (or one pair's two nibbles)
PLANE = 8  # bytes a bit plane: one bit for each byte of a chunk

if numba is not None:
    class _BFloat(_BaseFloatType):
        """LLVM's bfloat, which llvmlite's IR builder does not name (the BF16 intrinsics take it)."""
        null = "0.0"
        intrinsic_name = "bf16"

        def __str__(self):
            return "bfloat"

    _BFloat._create_instance()
    _I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
    _BYTES = ir.VectorType(_I8, CHUNK)
    _BFLOATS = ir.VectorType(_BFloat(), 32)
    SHORTS32 = Vector("i16", 32)

    def _interleaved(builder, codes, upper: bool):
        """Words 0x43 << 8 | code from the low (or upper) 8 bytes of each 128-bit lane: `vpunpck[lh]bw`."""
        first = 8 if upper else 0
        order = [index for lane in range(4) for j in range(first, first + 8)
                 for index in (16 * lane + j, CHUNK + 16 * lane + j)]
        words = builder.shuffle_vector(codes, ir.Constant(_BYTES, [0x43] * CHUNK),
                                       ir.Constant(ir.VectorType(_I32, CHUNK), order))
        return builder.bitcast(words, ir.VectorType(_I16, 32))

    def chunk_words(builder, address, offset, high_nibbles: bool, upper: bool, planes: int = 0):
        """32 bf16 words of 128 + q (as 32 i16) from the chunk at the byte address[offset]: its low (or high)
        nibbles, the outputs 0-15 (or 16-31); with `planes` bit planes after the 64 nibble bytes (the low
        nibbles' planes first, then the high ones'), plane p giving each code its bit 4 + p."""
        base = builder.gep(address, [offset])
        raw = builder.load(builder.bitcast(base, _BYTES.as_pointer()), align=1)
        if high_nibbles:
            raw = builder.lshr(raw, ir.Constant(_BYTES, [4] * CHUNK))
        codes = builder.and_(raw, ir.Constant(_BYTES, [15] * CHUNK))
        for plane in range(planes):
            at = ir.Constant(_I64, CHUNK + PLANE * (planes * high_nibbles + plane))
            bits = builder.load(builder.bitcast(builder.gep(base, [at]), _I64.as_pointer()), align=1)
            mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), CHUNK))
            codes = builder.select(mask, builder.or_(codes, ir.Constant(_BYTES, [16 << plane] * CHUNK)), codes)
        return _interleaved(builder, codes, upper)

    def words(high_nibbles: bool, upper: bool):
        """An intrinsic: `chunk_words` of a Q4 chunk (no planes) at a byte address[offset]."""
        @intrinsic
        def make(typingctx, address, offset):
            def codegen(context, builder, signature, args):
                return chunk_words(builder, args[0], args[1], high_nibbles, upper)
            return SHORTS32(address, offset), codegen
        return make

    @intrinsic
    def pair(typingctx, address, offset):
        """Two bf16 at a bf16 pointer's element `offset` (even) as one uint32."""
        def codegen(context, builder, signature, args):
            return builder.load(builder.bitcast(builder.gep(args[0], [args[1]]), _I32.as_pointer()), align=2)
        return types.uint32(address, offset), codegen

    @intrinsic
    def dot(typingctx, total, words_, pair_):
        """total + in each lane n: words[2n] * x0 + words[2n + 1] * x1 (`vdpbf16ps`, the pair spread)."""
        def codegen(context, builder, signature, args):
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(FLOATS16, [FLOATS16, _BFLOATS, _BFLOATS]),
                "llvm.x86.avx512bf16.dpbf16ps.512")
            lanes = ir.VectorType(_I32, 16)
            pairs = builder.insert_element(ir.Constant(lanes, None), args[2], ir.Constant(_I32, 0))
            pairs = builder.shuffle_vector(pairs, pairs, ir.Constant(lanes, [0] * 16))
            return builder.call(function, [args[0], builder.bitcast(args[1], _BFLOATS),
                                           builder.bitcast(pairs, _BFLOATS)])
        return FLOAT32x16(total, words_, types.uint32), codegen

    def spread(builder, scalar):
        """A scalar fp32 in all 16 lanes."""
        one = builder.insert_element(ir.Constant(FLOATS16, None), scalar, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))

    def fp16s(builder, address, offset):
        """16 fp16 at the byte address[offset], as fp32 (exact)."""
        vector = ir.VectorType(ir.HalfType(), 16)
        loaded = builder.load(builder.bitcast(builder.gep(address, [offset]), vector.as_pointer()), align=2)
        return builder.fpext(loaded, FLOATS16)

    def int8s(builder, address, offset):
        """16 int8 at the byte address[offset], as fp32 (exact)."""
        vector = ir.VectorType(_I8, 16)
        loaded = builder.load(builder.bitcast(builder.gep(address, [offset]), vector.as_pointer()), align=1)
        return builder.sitofp(loaded, FLOATS16)

    @intrinsic
    def halves16(typingctx, address, offset):
        """16 fp16 at the byte address[offset], as fp32 (exact)."""
        return FLOAT32x16(address, offset), lambda context, builder, signature, args: fp16s(builder, *args)

    def fma(builder, a, b, c):
        """a * b + c, lane by lane, one rounding."""
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS16, [FLOATS16] * 3),
                                                  "llvm.fma.v16f32")
        return builder.call(function, [a, b, c])

    @intrinsic
    def fma_vector(typingctx, total, a, b):
        """total + a * b, lane by lane, one rounding."""
        return FLOAT32x16(total, a, b), lambda context, builder, signature, args: fma(builder, args[1], args[2],
                                                                                        args[0])

    @intrinsic
    def fma_scalar(typingctx, total, a, b):
        """total + a * b with b a scalar spread, one rounding."""
        def codegen(context, builder, signature, args):
            return fma(builder, args[1], spread(builder, args[2]), args[0])
        return FLOAT32x16(total, a, types.float32), codegen

    @intrinsic
    def add(typingctx, a, b):
        return FLOAT32x16(a, b), lambda context, builder, signature, args: builder.fadd(args[0], args[1])

    @intrinsic
    def store_bf16(typingctx, address, offset, vector):
        """16 fp32 rounded to bf16 (nearest even) at a bf16 pointer's element `offset`."""
        def codegen(context, builder, signature, args):
            rounded = builder.fptrunc(args[2], ir.VectorType(_BFloat(), 16))
            target = builder.bitcast(builder.gep(args[0], [args[1]]), ir.VectorType(_BFloat(), 16).as_pointer())
            builder.store(rounded, target, align=2)
            return context.get_dummy_value()
        return types.void(address, offset, FLOAT32x16), codegen
