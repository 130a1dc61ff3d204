"""Four fp64 lanes as one LLVM vector, for numba kernels that must vectorise.

numba leaves vectorisation to LLVM, and LLVM does not vectorise the loops this project needs
most: a GGUF block's quants sit at byte offsets of a run (LLVM sees possibly negative indices
and makes gathers of them), and a sum of a few runs is one chain of dependent adds. Here a
kernel says what each group of four elements is — four bytes read as integers, a scale times
them, rounded — as operations on an ``f64x4`` value, an LLVM ``<4 x double>``; LLVM lowers
it to one AVX2 register, two SSE2 registers on a baseline x86-64 build, or what another
target has. Every operation is one IEEE operation per lane (add, subtract, multiply, round to
an integer, round to fp32, widen), the same bits on every target; ``fma`` is used only where
the product is exact, so fused or not gives the same sum. No fast-math flag is set.

Indices are element offsets into a 1-D C-contiguous array and are not checked: a caller reads
only inside the rows it was given (the stored shapes are checked when a weight is held).
Imported on first use only (it registers a numba type).
"""

from __future__ import annotations

import operator

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel import models
from numba.extending import intrinsic, overload, register_model

LANES = 4


class F64x4Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="f64x4")


f64x4 = F64x4Type()
_I32 = ir.IntType(32)
_VD = ir.VectorType(ir.DoubleType(), LANES)
_VF = ir.VectorType(ir.FloatType(), LANES)
_VI = ir.VectorType(_I32, LANES)


@register_model(F64x4Type)
class _F64x4Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VD)


def _address(context, builder, arrty, arr, index, lane_type):
    """A pointer to ``arr[index]`` as a pointer to ``lane_type`` (four elements)."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [index]), lane_type.as_pointer())


def _vector(builder, vtype, scalar):
    out = ir.Constant(vtype, ir.Undefined)
    for k in range(LANES):
        out = builder.insert_element(out, scalar, ir.Constant(_I32, k))
    return out


def _ints(values):
    return ir.Constant(_VI, [ir.Constant(_I32, v) for v in values])


def _call(builder, name: str, args):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_VD, [_VD] * len(args)), name
    )
    return builder.call(fn, args)


@intrinsic
def splat(typingctx, x):
    """x in every lane."""

    def codegen(context, builder, sig, args):
        return _vector(builder, _VD, args[0])

    return f64x4(types.float64), codegen


@intrinsic
def zeros(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VD, [ir.Constant(ir.DoubleType(), 0.0)] * LANES)

    return f64x4(), codegen


@intrinsic
def load(typingctx, arr, i):
    """arr[i..i+3] of an fp64 array, or of an fp32 one widened (exact)."""
    wide = arr.dtype == types.float64

    def codegen(context, builder, sig, args):
        lane_type = _VD if wide else _VF
        v = builder.load(
            _address(context, builder, sig.args[0], *args, lane_type), align=8 if wide else 4
        )
        return v if wide else builder.fpext(v, _VD)

    if arr.dtype not in (types.float64, types.float32):
        return None
    return f64x4(arr, types.intp), codegen


@intrinsic
def store(typingctx, arr, i, v):
    """arr[i..i+3] = v, an fp64 array."""

    def codegen(context, builder, sig, args):
        builder.store(
            args[2], _address(context, builder, sig.args[0], args[0], args[1], _VD), align=8
        )
        return context.get_dummy_value()

    return types.none(arr, types.intp, f64x4), codegen


@intrinsic
def store_f32(typingctx, arr, i, v):
    """arr[i..i+3] = v rounded to fp32 (exact where v holds fp32 values), an fp32 array."""

    def codegen(context, builder, sig, args):
        at = _address(context, builder, sig.args[0], args[0], args[1], _VF)
        builder.store(builder.fptrunc(args[2], _VF), at, align=4)
        return context.get_dummy_value()

    return types.none(arr, types.intp, f64x4), codegen


@intrinsic
def bytes_field(typingctx, arr, i, shift, mask):
    """``(b >> shift) & mask`` of the four bytes b at arr[i..i+3] (a uint8 array), as fp64."""

    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), LANES)
        b = builder.zext(
            builder.load(_address(context, builder, sig.args[0], *args[:2], vb), align=1), _VI
        )
        shift_, mask_ = (_vector(builder, _VI, builder.trunc(a, _I32)) for a in args[2:])
        return builder.sitofp(builder.and_(builder.lshr(b, shift_), mask_), _VD)

    return f64x4(arr, types.intp, types.intp, types.intp), codegen


@intrinsic
def five_bits(typingctx, arr, i, shift, w, first, offset):
    """Q5_0/Q5_1's quants minus ``offset``, as fp64: ``(b >> shift) & 15`` of the four bytes b
    at arr[i..i+3] with bits first..first+3 of the little-endian 32-bit word at arr[w..w+3]
    as their fifth bits, one a lane — put together as integers, then widened once."""

    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), LANES)
        b = builder.zext(
            builder.load(_address(context, builder, sig.args[0], *args[:2], vb), align=1), _VI
        )
        shift_ = _vector(builder, _VI, builder.trunc(args[2], _I32))
        low = builder.and_(builder.lshr(b, shift_), _ints([15] * LANES))
        word = builder.load(
            _address(context, builder, sig.args[0], args[0], args[3], _I32), align=1
        )
        first_ = _vector(builder, _VI, builder.trunc(args[4], _I32))
        bit = builder.lshr(_vector(builder, _VI, word), builder.add(first_, _ints(range(LANES))))
        high = builder.shl(builder.and_(bit, _ints([1] * LANES)), _ints([4] * LANES))
        q = builder.sub(builder.or_(low, high), _vector(builder, _VI, builder.trunc(args[5], _I32)))
        return builder.sitofp(q, _VD)

    i = types.intp
    return f64x4(arr, i, i, i, i, i), codegen


@intrinsic
def signed_bytes(typingctx, arr, i):
    """The four bytes at arr[i..i+3] (a uint8 array) read as int8, as fp64."""

    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), LANES)
        b = builder.load(_address(context, builder, sig.args[0], *args, vb), align=1)
        return builder.sitofp(builder.sext(b, _VI), _VD)

    return f64x4(arr, types.intp), codegen


@intrinsic
def half(typingctx, lo, hi):
    """The fp16 number with bytes lo, hi (little-endian), exactly, as fp64, without a branch:
    its fields moved into an fp32's places (infinity and NaN keep an all-ones exponent), that
    fp32 times 2**112 (subnormals included). A block's scale is decoded once a block, and a
    branch that mispredicts costs more than the block's 32 products."""

    def codegen(context, builder, sig, args):
        h = builder.or_(
            builder.zext(args[0], _I32), builder.shl(builder.zext(args[1], _I32), _I32(8))
        )
        low = builder.shl(builder.and_(h, _I32(0x7FFF)), _I32(13))
        bits = builder.or_(low, builder.shl(builder.and_(h, _I32(0x8000)), _I32(16)))
        special = builder.icmp_unsigned("==", builder.and_(h, _I32(0x7C00)), _I32(0x7C00))
        bits = builder.select(special, builder.or_(bits, _I32(0x7F800000)), bits)
        wide = builder.fpext(builder.bitcast(bits, ir.FloatType()), ir.DoubleType())
        return builder.fmul(wide, ir.Constant(ir.DoubleType(), 2.0**112))

    return types.float64(types.uint8, types.uint8), codegen


def _binary(name: str):
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, name)(*args)

        return f64x4(f64x4, f64x4), codegen

    return op


_add, _sub, _mul = _binary("fadd"), _binary("fsub"), _binary("fmul")


@intrinsic
def fma(typingctx, a, b, c):
    """a·b + c, fused where the target can. Only for an exact a·b (small integers, integers
    below 2**53): then fused and unfused give the same result."""

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fmuladd.v4f64", args)

    return f64x4(f64x4, f64x4, f64x4), codegen


@intrinsic
def rint(typingctx, a):
    """Each lane rounded to an integer, ties to even (numpy's rint)."""

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.rint.v4f64", args)

    return f64x4(f64x4), codegen


@intrinsic
def r32(typingctx, a):
    """Each lane rounded to fp32 (and widened back: exact)."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], _VF), _VD)

    return f64x4(f64x4), codegen


@intrinsic
def total(typingctx, a):
    """(a0 + a1) + (a2 + a3): the sum of integer-valued lanes, exact below 2**53."""

    def codegen(context, builder, sig, args):
        e = [builder.extract_element(args[0], ir.Constant(_I32, k)) for k in range(LANES)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    return types.float64(f64x4), codegen


@overload(operator.add)
def _overload_add(a, b):
    if a is f64x4 and b is f64x4:
        return lambda a, b: _add(a, b)
    return None


@overload(operator.sub)
def _overload_sub(a, b):
    if a is f64x4 and b is f64x4:
        return lambda a, b: _sub(a, b)
    return None


@overload(operator.mul)
def _overload_mul(a, b):
    if a is f64x4 and b is f64x4:
        return lambda a, b: _mul(a, b)
    return None


# --- a run of 32 quants as int16 lanes, multiplied by 16-bit limbs -----------------------------
#
# A run whose scale (and offset) are whole numbers has integers ``c1·q (+ c0)`` exactly, so its
# sum with x is ``c1·Σ q·x (+ c0·Σ x)``: the per-value rounding drops out and what remains is
# a sum of small integers q times x. With x split into two int16 limbs (``x = xh·2**16 + xl``)
# those are 16-bit products summed in pairs into 32-bit lanes — `pmaddwd`, 16 products an
# instruction on AVX2 where fp64 lanes take four — which LLVM makes of the plain mul-and-add
# below (or what another target has). Every step is integer arithmetic that cannot overflow
# (|q| <= 2**7, |limb| <= 2**15, four products a 32-bit lane), then one exact widening to fp64.

RUN = 32
_I8, _I16 = ir.IntType(8), ir.IntType(16)
_VQ = ir.VectorType(_I16, RUN)


class I16x32Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="i16x32")


i16x32 = I16x32Type()


@register_model(I16x32Type)
class _I16x32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _VQ)


def _indices(values):
    values = list(values)
    return ir.Constant(ir.VectorType(_I32, len(values)), [ir.Constant(_I32, v) for v in values])


def _bytes(context, builder, arrty, arr, index, n):
    """The n bytes at arr[index..] (a uint8 array) as an <n x i8>."""
    vb = ir.VectorType(_I8, n)
    return builder.load(_address(context, builder, arrty, arr, index, vb), align=1)


def _same(builder, vtype, value):  # one integer in every lane of an integer vector
    scalar = builder.trunc(value, vtype.element) if value.type != vtype.element else value
    v = builder.insert_element(ir.Constant(vtype, ir.Undefined), scalar, _I32(0))
    return builder.shuffle_vector(v, v, _indices([0] * vtype.count))


@intrinsic
def split_nibbles(typingctx, arr, i):
    """Q4_0's layout: the 16 bytes at arr[i..i+15], low nibbles (elements 0..15) then high."""

    def codegen(context, builder, sig, args):
        b = _bytes(context, builder, sig.args[0], *args, 16)
        low = builder.and_(b, _same(builder, b.type, _I8(15)))
        high = builder.lshr(b, _same(builder, b.type, _I8(4)))
        return builder.zext(builder.shuffle_vector(low, high, _indices(range(RUN))), _VQ)

    return i16x32(arr, types.intp), codegen


@intrinsic
def field(typingctx, arr, i, shift, mask):
    """``(b >> shift) & mask`` of each of the 32 bytes b at arr[i..i+31]."""

    def codegen(context, builder, sig, args):
        b = builder.zext(_bytes(context, builder, sig.args[0], args[0], args[1], RUN), _VQ)
        shift_, mask_ = (_same(builder, _VQ, a) for a in args[2:])
        return builder.and_(builder.lshr(b, shift_), mask_)

    return i16x32(arr, types.intp, types.intp, types.intp), codegen


@intrinsic
def word_bits(typingctx, arr, w):
    """Bit j of the little-endian 32-bit word at arr[w..w+3] in lane j (Q5_0's fifth bits):
    each byte repeated in eight lanes, each lane testing its own bit."""

    def codegen(context, builder, sig, args):
        b = _bytes(context, builder, sig.args[0], *args, 4)
        spread = builder.shuffle_vector(b, b, _indices([j // 8 for j in range(RUN)]))
        v8 = spread.type
        masks = ir.Constant(v8, [ir.Constant(_I8, 1 << (j % 8)) for j in range(RUN)])
        bit = builder.icmp_unsigned("!=", builder.and_(spread, masks), ir.Constant(v8, None))
        return builder.zext(bit, _VQ)

    return i16x32(arr, types.intp), codegen


@intrinsic
def signed_run(typingctx, arr, i):
    """The 32 bytes at arr[i..i+31] read as int8."""

    def codegen(context, builder, sig, args):
        return builder.sext(_bytes(context, builder, sig.args[0], *args, RUN), _VQ)

    return i16x32(arr, types.intp), codegen


@intrinsic
def joined(typingctx, low, high, shift, offset):
    """``low + (high << shift) - offset`` lane by lane (a quant's bits put together)."""

    def codegen(context, builder, sig, args):
        up = builder.shl(args[1], _same(builder, _VQ, args[2]))
        return builder.sub(builder.add(args[0], up), _same(builder, _VQ, args[3]))

    return i16x32(i16x32, i16x32, types.intp, types.intp), codegen


@intrinsic
def minus(typingctx, q, offset):
    """``q - offset`` lane by lane."""

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], _same(builder, _VQ, args[1]))

    return i16x32(i16x32, types.intp), codegen


def _limb_sums(context, builder, sig, args, pairs):
    """Σ q·x over the elements of `pairs` (neighbour pairs 0..15 of the 32), as fp64 lanes."""
    v32 = ir.VectorType(_I32, RUN)
    wide = builder.sext(args[0], v32)
    sums = []
    for arrty, arr in ((sig.args[1], args[1]), (sig.args[2], args[2])):
        x = builder.load(_address(context, builder, arrty, arr, args[3], _VQ), align=2)
        m = builder.mul(wide, builder.sext(x, v32))
        # pairs of neighbours (the shape `pmaddwd` is matched from), then halves
        s = builder.add(
            builder.shuffle_vector(m, m, _indices(range(0, RUN, 2))),
            builder.shuffle_vector(m, m, _indices(range(1, RUN, 2))),
        )
        if len(pairs) < s.type.count:
            s = builder.shuffle_vector(s, s, _indices(pairs))
        while s.type.count > LANES:
            n = s.type.count // 2
            s = builder.add(
                builder.shuffle_vector(s, s, _indices(range(n))),
                builder.shuffle_vector(s, s, _indices(range(n, 2 * n))),
            )
        sums.append(builder.sitofp(s, _VD))
    unit = ir.Constant(_VD, [ir.Constant(ir.DoubleType(), 2.0**16)] * LANES)
    return builder.fadd(builder.fmul(sums[1], unit), sums[0])


@intrinsic
def limb_dot(typingctx, q, low, high, o):
    """Σ q·x over the run, x = high·2**16 + low at elements o..o+31 of two int16 arrays, as
    four fp64 lanes of partial sums (each exact: below 2**42)."""

    def codegen(context, builder, sig, args):
        return _limb_sums(context, builder, sig, args, range(RUN // 2))

    if not (low.dtype == high.dtype == types.int16):
        return None
    return f64x4(i16x32, low, high, types.intp), codegen


@intrinsic
def limb_dot_first(typingctx, q, low, high, o):
    """`limb_dot` over elements 0..15 only (the first of two runs of 16)."""

    def codegen(context, builder, sig, args):
        return _limb_sums(context, builder, sig, args, range(RUN // 4))

    if not (low.dtype == high.dtype == types.int16):
        return None
    return f64x4(i16x32, low, high, types.intp), codegen


@intrinsic
def limb_dot_second(typingctx, q, low, high, o):
    """`limb_dot` over elements 16..31 only (the second of two runs of 16)."""

    def codegen(context, builder, sig, args):
        return _limb_sums(context, builder, sig, args, range(RUN // 4, RUN // 2))

    if not (low.dtype == high.dtype == types.int16):
        return None
    return f64x4(i16x32, low, high, types.intp), codegen
