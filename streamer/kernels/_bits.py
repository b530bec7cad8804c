"""Bit-level helpers shared by the kernels: IEEE half and bfloat16 decoding inside numba.

numba has no float16 type on the CPU, so the conversions are LLVM intrinsics: `fpext half`
lowers to vcvtph2ps (F16C) and vectorises; bf16 is the top half of an f32.
"""

from functools import partial, wraps

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic as numba_intrinsic

from . import _cachelock, _inline
from .specialise import format_kernel

# Fast-math flags for the matrix kernels: reassociation and contraction let LLVM vectorise the reductions
# and use FMA; no "nnan"/"ninf", so huge or tiny scales are not optimised on false premises. The forward's
# small ops (ops.py) keep numba's fastmath=True, all flags: their results are what the tests and the llama.cpp
# golden data were checked against, and a change of flags could change their last bits.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# numba's fastmath puts its flags on every float operation of a kernel that has none, the IR our intrinsics emit
# included. The intrinsics' arithmetic is written in the order it should run (vector accumulators, tree sums), and
# with `reassoc` LLVM may reorder it differently wherever the code is optimized: a kernel compiled in the process and
# the same kernel loaded from numba's cache (whose calls resolve to copies numba optimized again) then differ in the
# last bits (bench/fresh_vs_cached.py). `intrinsic` below marks the float operations an intrinsic emits without
# flags with `afn` alone, which changes nothing for them (it only licenses approximate library functions) and makes
# numba's pass leave them as written.
STRICT_FLAG = "afn"
_FLOAT_OPS = frozenset({"fadd", "fsub", "fmul", "fdiv", "frem", "fcmp"})


def declare(module, name, ret, args):
    """The module's declaration of function `name` (an LLVM intrinsic), added on first use."""
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name=name)


def _strict(codegen):
    def strict_codegen(context, builder, signature, args):
        start, n0 = builder.block, len(builder.block.instructions)
        old = {id(b) for b in builder.function.blocks}
        out = codegen(context, builder, signature, args)
        new = list(start.instructions[n0:])
        for b in builder.function.blocks:
            if id(b) not in old:
                new += b.instructions
        for ins in new:
            if getattr(ins, "opname", None) in _FLOAT_OPS and not ins.flags:
                ins.flags.append(STRICT_FLAG)
        return out

    return strict_codegen


def intrinsic(fn):
    """numba's @intrinsic, with the float operations it emits kept in their written order (see STRICT_FLAG)."""

    @wraps(fn)
    def typer(typingctx, *args):
        res = fn(typingctx, *args)
        if res is None:
            return None
        sig, codegen = res
        return sig, _strict(codegen)

    return numba_intrinsic(typer)


# Every kernel: cached on disk (safe for processes compiling at once: _cachelock), numpy's error model (no
# zero-division checks), runs without the GIL; its inlined helpers prepared once per process (_inline).
_cachelock.install()
_inline.install()
kernel = partial(njit, cache=True, error_model="numpy", nogil=True)


@kernel(inline="always")
def copy_row(src, t, dst, r):
    """dst[r] = src[t], or zeros where t < 0. Element by element: numba's row assignment (dst[r] = src[t]) checks
    the shapes with an error message built from strings, which cost the demo's first run 3.5 s of compiling its
    string code (2026-12-06, AMD EPYC Zen 4)."""
    if t >= 0:
        for c in range(dst.shape[1]):
            dst[r, c] = src[t, c]
    else:
        for c in range(dst.shape[1]):
            dst[r, c] = 0


def isa_kernels(source, isas, name, format_args=(), **options):
    """One kernel per instruction set from one source: `source(isa)` returns the Python function for isa (a closure
    whose branches test `isa`, a constant numba folds before typing, so the other sets' intrinsics are never
    typed: vpdpbusd does not compile for a CPU without it); each is compiled as `kernel(**options)` under the name
    f"{name}_{isa}" (numba's cache files and the start-up timing's kernel names), or as a FormatKernel compiled per
    code of `format_args` (specialise.py) if given. A dict isa -> dispatcher."""
    out = {}
    for isa in isas:
        fn = source(isa)
        fn.__name__ = fn.__qualname__ = f"{name}_{isa}"
        out[isa] = format_kernel(*format_args, **options)(fn) if format_args else kernel(**options)(fn)
    return out


@intrinsic
def f16_to_f32(typingctx, h):
    """The low 16 bits of an integer, read as an IEEE half, widened to float32 (exact)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width > 16:
            v = builder.trunc(v, ir.IntType(16))
        elif v.type.width < 16:
            v = builder.zext(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def bf16_to_f32(typingctx, h):
    """The low 16 bits of an integer, read as a bfloat16, widened to float32 (exact)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        v = builder.trunc(v, ir.IntType(16)) if v.type.width > 16 else v
        v = builder.zext(v, ir.IntType(32)) if v.type.width < 32 else v
        return builder.bitcast(builder.shl(v, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """float32 -> IEEE half (round to nearest even, like numpy's astype(float16)) as uint16 bits."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type != ir.FloatType():
            v = builder.fptrunc(v, ir.FloatType())
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def i32_as_f32(typingctx, v):
    """The 32 bits of an int32 read as a float32 (a bitcast, which LLVM vectorises)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        x = args[0]
        x = builder.trunc(x, ir.IntType(32)) if x.type.width > 32 else x
        x = builder.sext(x, ir.IntType(32)) if x.type.width < 32 else x
        return builder.bitcast(x, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32, rounded once (llvm.fma): the same bits in every kernel, where a fast-math
    `c + a * b` is contracted to an FMA, or not, by what LLVM made of the code around it (the weighted sums of
    expert outputs that the decode and the grouped prefill kernels must agree on bit for bit)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        vals = [builder.fptrunc(v, f) if v.type != f else v for v in args]
        return builder.call(declare(builder.module, "llvm.fma.f32", f, [f] * 3), vals)

    return types.float32(a, b, c), codegen
