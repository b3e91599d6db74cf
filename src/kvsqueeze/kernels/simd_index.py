"""Integer lanes, gathers and scatters for the numba kernels' sparse passes (see `simd.py` for the vector types).

The sparse passes give each of 16 lanes one slot (token of a row) and walk
the slots' outliers together; these intrinsics compute per-lane indices and
read and write memory at them. Masks are `U32x16` lanes of all ones (true) or
zero (false); masked-off lanes of a gather read nothing and give zero, of a
scatter write nothing. Indices are element indices into C-contiguous arrays.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _I32, _VF, _VI, LANES, _is_c_array, _splat, _to_i32, f32x16, u32x16

_I64 = ir.IntType(64)
_VB = ir.VectorType(ir.IntType(1), LANES)


def _as_vector(builder, value, ty):
    """A U32x16 argument as is, an integer scalar splatted to 16 lanes."""
    return value if isinstance(value.type, ir.VectorType) else _splat(builder, _to_i32(builder, value), _VI)


def _lanes_or_int(t) -> bool:
    return t == u32x16 or isinstance(t, types.Integer)


def _int_binop(name: str, doc: str):
    @intrinsic
    def op(typingctx, a, b):
        if not (_lanes_or_int(a) and _lanes_or_int(b)):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, name)(_as_vector(builder, args[0], a), _as_vector(builder, args[1], b))

        return u32x16(a, b), codegen

    op.__doc__ = doc
    return op


iadd = _int_binop("add", "a + b per uint32 lane (an integer operand is splatted).")
isub = _int_binop("sub", "a - b per uint32 lane.")
imul = _int_binop("mul", "a * b per uint32 lane (modulo 2**32).")
iand = _int_binop("and_", "a & b per lane.")
ior = _int_binop("or_", "a | b per lane.")
ishr = _int_binop("lshr", "a >> b per lane, logical; b < 32.")
ishl = _int_binop("shl", "a << b per lane; b < 32.")


def _compare(pred: str, doc: str):
    @intrinsic
    def op(typingctx, a, b):
        if not (_lanes_or_int(a) and _lanes_or_int(b)):
            return None

        def codegen(context, builder, sig, args):
            bit = builder.icmp_unsigned(pred, _as_vector(builder, args[0], a), _as_vector(builder, args[1], b))
            return builder.sext(bit, _VI)

        return u32x16(a, b), codegen

    op.__doc__ = doc
    return op


ilt = _compare("<", "Mask of a < b (unsigned).")
ine = _compare("!=", "Mask of a != b.")


@intrinsic
def ilanes(typingctx, start):
    """start + lane index, per lane."""
    if not isinstance(start, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(_splat(builder, _to_i32(builder, args[0]), _VI), ir.Constant(_VI, list(range(LANES))))

    return u32x16(start), codegen


@intrinsic
def ihmax(typingctx, v):
    """Largest lane (unsigned) as an int64 scalar."""
    if v != u32x16:
        return None

    def codegen(context, builder, sig, args):
        acc = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for i in range(1, LANES):
            x = builder.extract_element(args[0], ir.Constant(_I32, i))
            acc = builder.select(builder.icmp_unsigned(">", x, acc), x, acc)
        return builder.zext(acc, _I64)

    return types.int64(v), codegen


@intrinsic
def iselect(typingctx, mask, a, b):
    """a where mask, else b (uint32 lanes; integer operands are splatted)."""
    if mask != u32x16 or not (_lanes_or_int(a) and _lanes_or_int(b)):
        return None

    def codegen(context, builder, sig, args):
        bit = builder.icmp_unsigned("!=", args[0], ir.Constant(_VI, None))
        return builder.select(bit, _as_vector(builder, args[1], a), _as_vector(builder, args[2], b))

    return u32x16(mask, a, b), codegen


@intrinsic
def igather16(typingctx, arr, index, mask):
    """arr.flat[index] of a uint16 array per lane where mask (zero elsewhere), widened to uint32 lanes."""
    if not _is_c_array(arr) or arr.dtype != types.uint16 or index != u32x16 or mask != u32x16:
        return None

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.IntType(16), LANES)
        ptrs = _pointers(context, builder, sig.args[0], args[0], args[1])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [ptrs.type, _I32, _VB, vec]),
                                            "llvm.masked.gather.v16i16.v16p0")
        got = builder.call(fn, [ptrs, ir.Constant(_I32, 2), _mask_bits(builder, args[2]), ir.Constant(vec, None)])
        return builder.zext(got, _VI)

    return u32x16(arr, index, mask), codegen


@intrinsic
def fselect(typingctx, mask, a, b):
    """a where mask, else b (float lanes)."""
    if mask != u32x16 or a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):
        bit = builder.icmp_unsigned("!=", args[0], ir.Constant(_VI, None))
        return builder.select(bit, args[1], args[2])

    return f32x16(mask, a, b), codegen


# ---- memory at per-lane indices ---------------------------------------------------------------------
# numba dtype -> (LLVM element, bytes, name in the intrinsic)
_ELEMENTS = {types.float32: (ir.FloatType(), 4, "f32"), types.uint32: (_I32, 4, "i32"), types.int32: (_I32, 4, "i32"),
             types.uint16: (ir.IntType(16), 2, "i16")}


def _pointers(context, builder, aryty, ary, index):
    """Vector of addresses of arr.flat[index] (llvmlite's gep takes no vector indices)."""
    data = context.make_array(aryty)(context, builder, ary).data
    size = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
    vi64 = ir.VectorType(_I64, LANES)
    offsets = builder.mul(builder.zext(index, vi64), ir.Constant(vi64, [size] * LANES))
    base = _splat(builder, builder.ptrtoint(data, _I64), vi64)
    return builder.inttoptr(builder.add(base, offsets), ir.VectorType(data.type, LANES))


def _mask_bits(builder, mask):
    return builder.icmp_unsigned("!=", mask, ir.Constant(_VI, None))


@intrinsic
def gather(typingctx, arr, index, mask):
    """arr.flat[index] per lane where mask, zero elsewhere.

    float32 arrays give float32 lanes, uint16 arrays are read as fp16 bit patterns and give their float32
    values, (u)int32 arrays give uint32 lanes.
    """
    if not _is_c_array(arr) or arr.dtype not in _ELEMENTS or index != u32x16 or mask != u32x16:
        return None
    elem, size, name = _ELEMENTS[arr.dtype]
    out = f32x16 if arr.dtype in (types.float32, types.uint16) else u32x16

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(elem, LANES)
        ptrs = _pointers(context, builder, sig.args[0], args[0], args[1])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [ptrs.type, _I32, _VB, vec]),
                                            f"llvm.masked.gather.v16{name}.v16p0")
        got = builder.call(fn, [ptrs, ir.Constant(_I32, size), _mask_bits(builder, args[2]), ir.Constant(vec, None)])
        if size == 2:
            return builder.fpext(builder.bitcast(got, ir.VectorType(ir.HalfType(), LANES)), _VF)
        return got

    return out(arr, index, mask), codegen


@intrinsic
def scatter(typingctx, arr, index, value, mask):
    """arr.flat[index] = value per lane where mask (float32 array; indices of active lanes must differ)."""
    if not _is_c_array(arr) or arr.dtype != types.float32 or index != u32x16 or value != f32x16 or mask != u32x16:
        return None

    def codegen(context, builder, sig, args):
        ptrs = _pointers(context, builder, sig.args[0], args[0], args[1])
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_VF, ptrs.type, _I32, _VB]), "llvm.masked.scatter.v16f32.v16p0")
        builder.call(fn, [args[2], ptrs, ir.Constant(_I32, 4), _mask_bits(builder, args[3])])
        return context.get_dummy_value()

    return types.void(arr, index, value, mask), codegen
