"""Sixteen-lane vectors for the numba kernels: LLVM vector types exposed as numba intrinsics.

numba's auto-vectorizer leaves table lookups scalar and keeps loop-carried sums
in memory; these intrinsics let the kernels hold accumulators in vector
registers and look codes up with a variable permute. They emit portable LLVM
IR, except the lookup, which is one 16-lane `vpermps` on AVX-512, and on AVX2
two 8-lane `vpermps` per half of the lanes with a blend on the index's fourth
bit (2.1x faster key and value passes than LLVM's lane-by-lane lowering on an
AMD EPYC), and for codes of at most 3 bits (`vlookup8`) one per half, no blend;
elsewhere (ARM NEON, ...) LLVM lowers a lane-by-lane form. `ISA`
says which one the kernels were compiled with, and `AVX2_ENV` makes an
AVX-512 machine compile the AVX2 one, so that either machine tests both.

Every operation is exact IEEE float32 arithmetic: `vfma` is the correctly
rounded fused multiply-add (`llvm.fma`), `vhsum` sums lanes in index order,
so results do not depend on the machine's vector width.

Types: `F32x16` (float32 lanes), `U32x16` (uint32 lanes). Memory operands are
C-contiguous numpy arrays addressed by flat element index. `f16` reads an fp16
bit pattern (numba has no float16 type) as float32,
`half_bits` rounds a float32 to one.
"""

from __future__ import annotations

import llvmlite.binding
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

if llvmlite.binding.llvm_version_info < (17,):
    # the masked-memory intrinsics below are named for opaque pointers, LLVM's only kind from 17 on
    raise ImportError(f"kvsqueeze's numba kernels need llvmlite built on LLVM >= 17 (numba >= 0.62), found "
                      f"LLVM {'.'.join(map(str, llvmlite.binding.llvm_version_info))}; upgrade numba, or use "
                      "the reference backend")

LANES = 16


def _target_isa() -> str:
    """The instruction set numba compiles for: "avx512", "avx2" or "generic". It is the host's unless
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another (numba's cache is keyed on both, so code compiled for one
    never runs as another); `AVX2_ENV` makes an AVX-512 machine compile, run and test the AVX2 path."""
    if config.CPU_FEATURES is not None:
        features = {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    else:
        features = {name for name, on in llvmlite.binding.get_host_cpu_features().items() if on}
    return "avx512" if "avx512f" in features else "avx2" if "avx2" in features else "generic"


AVX2_ENV = {  # a Haswell-class target: AVX2 and FMA, no AVX-512 (AMD EPYC Rome and earlier, Intel client cores)
    "NUMBA_CPU_NAME": "haswell",
    "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,"
                          "+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave",
}
ISA = _target_isa()
_I32 = ir.IntType(32)
_VF = ir.VectorType(ir.FloatType(), LANES)
_VI = ir.VectorType(_I32, LANES)
_VB = ir.VectorType(ir.IntType(1), LANES)


class F32x16(types.Type):
    def __init__(self):
        super().__init__(name="F32x16")


class U32x16(types.Type):
    def __init__(self):
        super().__init__(name="U32x16")


f32x16, u32x16 = F32x16(), U32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(U32x16)
class _U32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


# ---- helpers (code generation) ------------------------------------------------------------------
def _vec_of(dtype):
    return {types.float32: (f32x16, _VF), types.uint32: (u32x16, _VI)}.get(dtype, (None, None))


def _address(context, builder, aryty, ary, index, vecty):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), vecty.as_pointer())


def _splat(builder, scalar, vecty):
    v = builder.insert_element(ir.Constant(vecty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vecty, ir.Undefined), ir.Constant(_VI, [0] * LANES))


def _to_i32(builder, value):
    width = value.type.width
    return builder.trunc(value, _I32) if width > 32 else builder.zext(value, _I32) if width < 32 else value


def _lane_mask(builder, valid):
    """Lanes 0..valid-1 true."""
    lanes = ir.Constant(_VI, list(range(LANES)))
    return builder.icmp_signed("<", lanes, _splat(builder, _to_i32(builder, valid), _VI))


def _is_c_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.layout == "C"


# ---- memory --------------------------------------------------------------------------------------
@intrinsic
def vload(typingctx, arr, index):
    """Lanes arr.flat[index : index + 16] (float32 or uint32 array)."""
    vt, ll = _vec_of(getattr(arr, "dtype", None))
    if vt is None or not _is_c_array(arr) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_address(context, builder, sig.args[0], args[0], args[1], ll), align=4)

    return vt(arr, index), codegen


@intrinsic
def vload_first(typingctx, arr, index, valid):
    """Like `vload`, reading only lanes < valid (the others are zero): safe at an array's end."""
    vt, ll = _vec_of(getattr(arr, "dtype", None))
    if vt is None or not _is_c_array(arr):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ll, [ll.as_pointer(), _I32, _VB, ll]),
            f"llvm.masked.load.v16{'f32' if ll is _VF else 'i32'}.p0")
        ptr = _address(context, builder, sig.args[0], args[0], args[1], ll)
        return builder.call(fn, [ptr, ir.Constant(_I32, 4), _lane_mask(builder, args[2]), ir.Constant(ll, None)])

    return vt(arr, index, valid), codegen


@intrinsic
def vgather(typingctx, arr, index, stride, valid):
    """Lanes arr.flat[index + i * stride] for i < valid, zero for the others (float32 or uint32 array;
    15 * stride below 2**31)."""
    vt, ll = _vec_of(getattr(arr, "dtype", None))
    if vt is None or not _is_c_array(arr):
        return None

    def codegen(context, builder, sig, args):
        ptrs = _strided_pointers(context, builder, sig.args[0], args[0], args[1], args[2], sig.args[2], 4)
        return _gather(builder, ptrs, ll, 4, args[3])

    return vt(arr, index, stride, valid), codegen


def _lane_pointers(context, builder, aryty, ary, base, offsets, elem):
    """Pointers to arr.flat[base + offsets[i]] (base: a scalar integer; offsets: int32 lanes, below 2**31),
    as <16 x ptr>. Offsets enter sign-extended from 32 bits, the form x86 gathers take as 32-bit indices
    (one 16-lane `vpgatherdd` rather than two 8-lane gathers with 64-bit addresses)."""
    i64 = ir.IntType(64)
    vi64 = ir.VectorType(i64, LANES)
    data = context.make_array(aryty)(context, builder, ary).data
    start = builder.ptrtoint(builder.gep(data, [base]), i64)
    step = builder.mul(builder.sext(offsets, vi64), _splat(builder, ir.Constant(i64, elem), vi64))
    return builder.inttoptr(builder.add(_splat(builder, start, vi64), step), ir.VectorType(data.type, LANES))


def _strided_pointers(context, builder, aryty, ary, base, stride, stride_type, elem):
    """Pointers to arr.flat[base + i * stride], i = 0..15 (15 * stride below 2**31)."""
    step = _splat(builder, _to_i32(builder, context.cast(builder, stride, stride_type, types.int64)), _VI)
    return _lane_pointers(context, builder, aryty, ary, base, builder.mul(ir.Constant(_VI, list(range(LANES))), step),
                          elem)


def _gather(builder, ptrs, vecty, align, valid):
    """`llvm.masked.gather` of <16 x elem> through `ptrs`, lanes >= valid zero."""
    elem = {ir.FloatType(): "f32", _I32: "i32", ir.IntType(16): "i16"}[vecty.element]
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vecty, [ptrs.type, _I32, _VB, vecty]),
                                        f"llvm.masked.gather.v16{elem}.v16p0")
    return builder.call(fn, [ptrs, ir.Constant(_I32, align), _lane_mask(builder, valid), ir.Constant(vecty, None)])


@intrinsic
def vindex16(typingctx, arr, base, offsets, valid):
    """Lanes arr.flat[base + offsets[i]] of a uint16 array, zero-extended, for i < valid (zero for the others;
    offsets: uint32 lanes below 2**31)."""
    if not _is_c_array(arr) or arr.dtype != types.uint16 or offsets != u32x16:
        return None

    def codegen(context, builder, sig, args):
        ptrs = _lane_pointers(context, builder, sig.args[0], args[0], args[1], args[2], 2)
        return builder.zext(_gather(builder, ptrs, ir.VectorType(ir.IntType(16), LANES), 2, args[3]), _VI)

    return u32x16(arr, base, offsets, valid), codegen


@intrinsic
def vindex(typingctx, arr, base, offsets, valid):
    """Lanes arr.flat[base + offsets[i]] for i < valid, zero for the others (float32 or uint32 array; offsets:
    uint32 lanes below 2**31)."""
    vt, ll = _vec_of(getattr(arr, "dtype", None))
    if vt is None or not _is_c_array(arr) or offsets != u32x16:
        return None

    def codegen(context, builder, sig, args):
        ptrs = _lane_pointers(context, builder, sig.args[0], args[0], args[1], args[2], 4)
        return _gather(builder, ptrs, ll, 4, args[3])

    return vt(arr, base, offsets, valid), codegen


@intrinsic
def vscatter(typingctx, arr, base, offsets, value, valid):
    """arr.flat[base + offsets[i]] = value[i] for i < valid (float32 array; offsets below 2**31). Lanes must
    not share an element: which of two colliding lanes lands is not specified."""
    if not _is_c_array(arr) or arr.dtype != types.float32 or offsets != u32x16 or value != f32x16:
        return None

    def codegen(context, builder, sig, args):
        ptrs = _lane_pointers(context, builder, sig.args[0], args[0], args[1], args[2], 4)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_VF, ptrs.type, _I32, _VB]),
            "llvm.masked.scatter.v16f32.v16p0")
        builder.call(fn, [args[3], ptrs, ir.Constant(_I32, 4), _lane_mask(builder, args[4])])
        return context.get_dummy_value()

    return types.void(arr, base, offsets, value, valid), codegen


@intrinsic
def vstore(typingctx, arr, index, value):
    """arr.flat[index : index + 16] = value (float32 or uint32 array, matching the vector)."""
    vt, ll = _vec_of(getattr(arr, "dtype", None))
    if vt is None or not _is_c_array(arr) or value != vt:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _address(context, builder, sig.args[0], args[0], args[1], ll), align=4)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def vstore_first(typingctx, arr, index, value, valid):
    """Like `vstore`, writing only lanes < valid."""
    if not _is_c_array(arr) or arr.dtype != types.float32 or value != f32x16:
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_VF, _VF.as_pointer(), _I32, _VB]),
            "llvm.masked.store.v16f32.p0")
        ptr = _address(context, builder, sig.args[0], args[0], args[1], _VF)
        builder.call(fn, [args[2], ptr, ir.Constant(_I32, 4), _lane_mask(builder, args[3])])
        return context.get_dummy_value()

    return types.void(arr, index, value, valid), codegen


# ---- float arithmetic ----------------------------------------------------------------------------
@intrinsic
def vsplat(typingctx, x):
    """All lanes = x (converted to float32)."""
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)

    return f32x16(x), codegen


def _float_binop(name: str):
    @intrinsic
    def op(typingctx, a, b):
        if a != f32x16 or b != f32x16:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, name)(args[0], args[1])

        return f32x16(a, b), codegen

    op.__doc__ = f"Lane-wise IEEE float32 {name[1:]}."
    return op


vadd, vsub, vmul = _float_binop("fadd"), _float_binop("fsub"), _float_binop("fmul")


def _fused(negate_addend: bool):
    @intrinsic
    def op(typingctx, a, b, c):
        if not (a == b == c == f32x16):
            return None

        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                                "llvm.fma.v16f32")
            x, y, z = args
            return builder.call(fn, [x, y, builder.fneg(z) if negate_addend else z])

        return f32x16(a, b, c), codegen

    op.__doc__ = f"a * b {'-' if negate_addend else '+'} c, rounded once (IEEE fusedMultiplyAdd)."
    return op


vfma, vfms = _fused(False), _fused(True)


def _fold_lanes(builder, v, combine):
    """combine(...combine(combine(v[0], v[1]), v[2])..., v[15]): a scalar, lanes taken in index order."""
    acc = builder.extract_element(v, ir.Constant(_I32, 0))
    for i in range(1, LANES):
        acc = combine(acc, builder.extract_element(v, ir.Constant(_I32, i)))
    return acc


@intrinsic
def vhsum(typingctx, v):
    """Sum of the lanes, added in lane order: a float32 scalar."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _fold_lanes(builder, args[0], builder.fadd)

    return types.float32(v), codegen


@intrinsic
def vmax(typingctx, a, b):
    """Lane-wise maximum (b where a is NaN)."""
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return f32x16(a, b), codegen


@intrinsic
def vhmax(typingctx, v):
    """Largest lane, a float32 scalar."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _fold_lanes(builder, args[0], lambda acc, x: builder.select(builder.fcmp_ordered(">", x, acc), x, acc))

    return types.float32(v), codegen


# exp: Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and the Cephes expf polynomial (about 1 ulp)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@intrinsic
def vexp(typingctx, x):
    """e**x per lane (about 1 ulp) for x <= 88; -inf, and anything below -87.3 (whose e**x is subnormal), give 0."""
    if x != f32x16:
        return None

    def codegen(context, builder, sig, args):
        def const(v):
            return ir.Constant(_VF, [float(v)] * LANES)

        x = args[0]
        low = builder.fcmp_ordered("<", x, const(-87.33654))
        x = builder.select(low, const(-87.33654), builder.select(builder.fcmp_ordered(">", x, const(88.0)),
                                                                const(88.0), x))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF]), "llvm.floor.v16f32")
        n = builder.call(fn, [builder.fadd(builder.fmul(x, const(1.44269504088896341)), const(0.5))])
        r = builder.fsub(builder.fsub(x, builder.fmul(n, const(0.693359375))), builder.fmul(n, const(-2.12194440e-4)))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
        y = const(_EXP_POLY[0])
        for c in _EXP_POLY[1:]:  # Horner steps, each one fused multiply-add
            y = builder.call(fma, [y, r, const(c)])
        y = builder.fadd(builder.call(fma, [y, builder.fmul(r, r), r]), const(1.0))
        scale = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * LANES)),
                            ir.Constant(_VI, [23] * LANES))  # 2**n as float bits; n in [-126, 128)
        y = builder.fmul(y, builder.bitcast(scale, _VF))
        return builder.select(low, ir.Constant(_VF, None), y)

    return f32x16(x), codegen


@intrinsic
def f16(typingctx, bits16):
    """The float32 value of an IEEE half given by its 16-bit pattern (uint16); exact."""
    if not isinstance(bits16, types.Integer) or bits16.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits16), codegen


@intrinsic
def half_bits(typingctx, x):
    """The 16-bit pattern (uint16) of float32 x rounded to an IEEE half (to nearest, ties to even: what torch's
    `.half()` does)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def vhalf(typingctx, bits):
    """The float32 values of IEEE halves given by the low 16 bits of each lane; exact."""
    if bits != u32x16:
        return None

    def codegen(context, builder, sig, args):
        halves = builder.bitcast(builder.trunc(args[0], ir.VectorType(ir.IntType(16), LANES)),
                                 ir.VectorType(ir.HalfType(), LANES))
        return builder.fpext(halves, _VF)

    return f32x16(bits), codegen


# ---- integer lanes -------------------------------------------------------------------------------
@intrinsic
def ulanes(typingctx):
    """The lane numbers 0, 1, ..., 15 (uint32)."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, list(range(LANES)))

    return u32x16(), codegen


def _uint_op(name: str, doc: str):
    @intrinsic
    def op(typingctx, a, b):
        if a != u32x16 or not (b == u32x16 or isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            x, y = args
            if sig.args[1] != u32x16:
                y = _splat(builder, _to_i32(builder, y), _VI)
            if name == "umin":
                return builder.select(builder.icmp_unsigned("<", x, y), x, y)
            return getattr(builder, name)(x, y)

        return u32x16(a, b), codegen

    op.__doc__ = f"Lane-wise uint32 {doc} (b: lanes, or an integer for every lane; arithmetic modulo 2**32)."
    return op


uadd = _uint_op("add", "a + b")
umul = _uint_op("mul", "a * b")
ushr = _uint_op("lshr", "a >> b (b < 32)")
uand = _uint_op("and_", "a & b")
umin = _uint_op("umin", "minimum")


@intrinsic
def vbelow(typingctx, a, limit):
    """1.0 in the lanes where a < limit (unsigned; `limit` an integer for every lane), 0.0 elsewhere."""
    if a != u32x16 or not isinstance(limit, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        below = builder.icmp_unsigned("<", args[0], _splat(builder, _to_i32(builder, args[1]), _VI))
        return builder.uitofp(below, _VF)

    return f32x16(a, limit), codegen


@intrinsic
def vpick(typingctx, a, b, index, bit):
    """Lane-wise b where index & bit is set, else a (`bit` an integer for every lane): one blend, which with
    `vlookup` reads tables wider than 16 entries by permutes instead of gathers."""
    if a != f32x16 or b != f32x16 or index != u32x16 or not isinstance(bit, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x, y, idx, which = args
        mask = _splat(builder, _to_i32(builder, which), _VI)
        on = builder.icmp_unsigned("!=", builder.and_(idx, mask), ir.Constant(_VI, [0] * LANES))
        return builder.select(on, y, x)

    return f32x16(a, b, index, bit), codegen


# ---- codes ---------------------------------------------------------------------------------------
@intrinsic
def vfunnel(typingctx, lo, hi, shift):
    """The 32 bits of (hi:lo) starting at bit `shift` (0 <= shift < 32; one for all lanes, or uint32 lanes) per
    lane: `llvm.fshr`, one `vpshrdvd` where AVX512-VBMI2 exists. The code at bit `shift` of lo, straddling into hi or not, lands in the low bits."""
    if lo != u32x16 or hi != u32x16 or not (shift == u32x16 or isinstance(shift, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        lo, hi, sh = args
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VI, _VI, _VI]), "llvm.fshr.v16i32")
        return builder.call(fn, [hi, lo, sh if sig.args[2] == u32x16 else _splat(builder, _to_i32(builder, sh), _VI)])

    return u32x16(lo, hi, shift), codegen


@intrinsic
def vlookup(typingctx, table, index):
    """table[index & 15] per lane, for a 16-entry table vector: a variable permute that reads only the low
    four bits of each index (callers may leave higher bits set)."""
    if table != f32x16 or index != u32x16:
        return None

    def codegen(context, builder, sig, args):
        return _lookup_ir(builder, *args)

    return f32x16(table, index), codegen


def _lookup_ir(builder, tab, idx):
    """The IR of `vlookup` for the target's instruction set."""
    if ISA == "avx512":  # one vpermps, which ignores the index bits above the fourth by definition
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VI]),
                                            "llvm.x86.avx512.permvar.sf.512")
        return builder.call(fn, [tab, idx])
    if ISA == "avx2":
        return _lookup_avx2(builder, tab, idx)
    # elsewhere (ARM NEON, ...) LLVM lowers this lane-by-lane form to the target's own table lookups
    idx = builder.and_(idx, _splat(builder, ir.Constant(_I32, LANES - 1), _VI))
    out = ir.Constant(_VF, ir.Undefined)
    for i in range(LANES):
        lane = ir.Constant(_I32, i)
        out = builder.insert_element(out, builder.extract_element(tab, builder.extract_element(idx, lane)), lane)
    return out


@intrinsic
def vlookup8(typingctx, table, index):
    """table[index & 7] per lane, for a table whose first 8 entries hold every level (codes of at most 3 bits,
    the levels repeated with a period dividing 8): on AVX2 one 8-lane `vpermps` per half of the lanes, no blend;
    elsewhere as `vlookup`, whose result it equals on such tables."""
    if table != f32x16 or index != u32x16:
        return None

    def codegen(context, builder, sig, args):
        tab, idx = args
        if ISA == "avx2":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F, _V8I]),
                                                "llvm.x86.avx2.permps")
            low = builder.shuffle_vector(tab, tab, ir.Constant(_V8I, list(range(8))))
            out = [builder.call(fn, [low, builder.shuffle_vector(idx, idx, ir.Constant(_V8I, list(range(f, f + 8))))])
                   for f in (0, 8)]
            return builder.shuffle_vector(out[0], out[1], ir.Constant(_VI, list(range(LANES))))
        return _lookup_ir(builder, tab, idx)  # the table repeats every 8 entries: index bit 3 selects alike

    return f32x16(table, index), codegen


_V8F = ir.VectorType(ir.FloatType(), 8)
_V8I = ir.VectorType(_I32, 8)


def _lookup_avx2(builder, tab, idx):
    # Two 8-lane halves of the table, two 8-lane permutes (vpermps reads the low three index bits) per half of
    # the lanes, and bit 3 of each index picks between them: 4 permutes and 2 blends for 16 lanes.
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F, _V8I]), "llvm.x86.avx2.permps")

    def half(vec, first):
        return builder.shuffle_vector(vec, vec, ir.Constant(_V8I, list(range(first, first + 8))))

    low, high = half(tab, 0), half(tab, 8)
    eight = ir.Constant(_V8I, [8] * 8)
    zero = ir.Constant(_V8I, [0] * 8)
    out = []
    for first in (0, 8):
        i = half(idx, first)
        upper = builder.icmp_unsigned("!=", builder.and_(i, eight), zero)
        out.append(builder.select(upper, builder.call(fn, [high, i]), builder.call(fn, [low, i])))
    return builder.shuffle_vector(out[0], out[1], ir.Constant(_VI, list(range(LANES))))
