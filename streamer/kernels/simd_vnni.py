"""Decode row dots over int8 activation digits with vpdpbusd (AVX512-VNNI), or its AVX2 form: the Q4_K row dot without
widening.

simd.py's Q4_K dot widens every nibble to a word and sums pairs against int16 x (vpmaddwd): compute-bound. Here the
nibbles stay bytes: one 64-byte load of qs gives, as its low nibbles, sub-blocks 2c and 2c + 2 (c = 0 or 2) and, as its
high nibbles, 2c + 1 and 2c + 3; `vpdpbusd` (u8 x s8, 4 products summed into each int32 lane) dots each nibble vector
with x directly. Each int32 lane holds 4 products of ONE sub-block, so the sub-block scale is applied per lane in f32:
acc += float(isum) * (d * sc_j * dx_j). digits32 (below) lays x out in that order, per super-block b (512 bytes): [h =
0, 1][nibble n = lo, hi][digit hi, lo][64 bytes: elements 128h + 64(k // 32) + 32n + k % 32, k < 64].

Accuracy: as simd_i8.py's prefill kernel, x is held as two int8 digits q = 256 hi + lo, q = rint(x / dx_j), dx_j = max|x
in sub-block j| / XA_MAX (32639), per 32 elements. isum is exact in int32 and below 2^21, so float(isum) is exact; d *
sc_j is exact in f32; (d * sc_j) * dx_j rounds once. Per output:
    |out - W.x| <= sum_k A_k (dx_j(k)/2 + 4u|x_k|) + gamma_n sum_k A_k |x_k|,   u = 2^-24,
n = n_in + n_in/16 + 8, A_k = |w_k| plus the min term's magnitude (tests/test_kernels.py's formula with the activation
grid (32, XA_MAX)). The mins use exact f32 sums of x per 32, as simd.py's dot does.

One digit (AVX2's default, or STREAM_RUN_ACT=int8: int8.DIGITS == 1; ggml's q8 grid, here per 32 elements): q = rint(x /
dx_j) in [-127, 127], dx_j = max|x in sub-block j| / 127, at digits32's one-digit bytes (SB_BYTES1 per super-block); one
vpdpbusd per 64 weights and no shift. The mins take float(sum q) dx_j (ggml's bsums), so the product is W . (q dx) to
f32 rounding (tests/test_decode_digits.py). The bound holds with the grid (32, 127): coarse enough to miss the model
tests' 1% of the largest logit (tests/test_moe.py), hence opt-in on VNNI. The buffer's bytes are typed uint8 to tell the
kernels apart (blocks.act_buffer).

The same bodies can sum their 4 products per lane with AVX2 (_dp_avx2: vpmaddubsw, then vpmaddwd by 1): the same
int32 lanes and bits as vpdpbusd. The one-digit decode uses that where the CPU has no AVX512-VNNI; the two-digit
decode there uses simd_avx2.py's body, which folds the sub-block scales into vpmaddwd (2026-12-03: 1.16-1.19x this
AVX2 body). int8.decode_isa() decides, in Python, whether these run at all ('vnni' or 'avx2'): the vpdpbusd intrinsic
does not compile for a CPU without AVX512-VNNI. The kernels take them when given the activation buffer as int8 digits
(blocks.prepare / blocks.dot branch on its dtype at compile time); int16 keeps simd.py's path."""

from functools import partial

from llvmlite import ir
from numba import types

from ._bits import intrinsic
from .activations import XD1_MAX, XD_MAX
from .simd import F32, I8, I16, I32, I64, SplitBody, V, _c_array, _Emit, _k4_scales, _kquant_mins, _row_intrinsic
from .simd_i8 import _dp_vnni, _vcall, abs_max, group_digits

SB_BYTES = 512  # activation digit bytes per 256-element super-block
SB_BYTES1 = 256  # ... with one digit per element: [h = 0, 1][nibble n = lo, hi][64 bytes], elements as above


def digit_offset(e, digits=2):
    """Byte offset, inside its super-block's SB_BYTES (two digits) or SB_BYTES1 (one) bytes, of element e's hi
    digit (its lo digit is 64 further) or its one digit."""
    h, r = divmod(e, 128)
    return digits * (128 * h + 64 * ((r % 64) // 32)) + 32 * (r // 64) + r % 32


def _dp_avx2(e, acc, w, x):
    """vpdpbusd on AVX2: acc + the sums of 4 adjacent u8(w) * s8(x) products, per half of 32 bytes vpmaddubsw (pairs,
    into int16) then vpmaddwd by 1 (pairs of pairs, into int32). Exact, the same int32 lanes as vpdpbusd, where no
    pair sum passes int16, i.e. for codes w <= 127 (Q4_K's nibbles: at most 2 * 15 * 128 = 3840)."""
    bb = e.b
    mub = e.declare("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [V(I8, 32), V(I8, 32)])
    mwd = e.declare("llvm.x86.avx2.pmadd.wd", V(I32, 8), [V(I16, 16), V(I16, 16)])
    ones = ir.Constant(V(I16, 16), [1] * 16)
    half = []
    for h in range(2):
        at = list(range(32 * h, 32 * h + 32))
        half.append(bb.call(mwd, [bb.call(mub, [e.shuffle(w, w, at), e.shuffle(x, x, at)]), ones]))
    return bb.add(acc, e.shuffle(half[0], half[1], list(range(16))))


def _dp2_avx2(e, ws, xh, xl=None):
    """256 * sum_s dot4(ws[s], xh[s]) + sum_s dot4(ws[s], xl[s]) per int32 lane (dot4: vpdpbusd's sum of 4 adjacent
    u8 x s8 products; up to 8 vectors of 64 bytes) on AVX2, per 32-byte half: the vpmaddubsw pair sums (<= 3840 for
    codes <= 15) added over s in int16 (<= 30720: exact), then one vpmaddwd per digit, by 256 and by 1, and added.
    xl None: one digit, sum_s dot4(ws[s], xh[s]) (one vpmaddwd, by 1). The decode row dot takes one vector (s < 1),
    simd_lanes.py's AVX2 form Tv."""
    bb = e.b
    mub = e.declare("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [V(I8, 32), V(I8, 32)])
    mwd = e.declare("llvm.x86.avx2.pmadd.wd", V(I32, 8), [V(I16, 16), V(I16, 16)])
    one = ir.Constant(V(I16, 16), [1] * 16)
    digits = ((xh, one),) if xl is None else ((xh, ir.Constant(V(I16, 16), [256] * 16)), (xl, one))
    half = []
    for h in range(2):
        at = list(range(32 * h, 32 * h + 32))
        acc = None
        for xs, k in digits:
            p = None
            for w, x in zip(ws, xs):
                m = bb.call(mub, [e.shuffle(w, w, at), e.shuffle(x, x, at)])
                p = m if p is None else bb.add(p, m)
            d = bb.call(mwd, [p, k])
            acc = d if acc is None else bb.add(acc, d)
        half.append(acc)
    return e.shuffle(half[0], half[1], list(range(16)))


def _digits_dot(e, dp, ws, xh, xl=None):
    """256 * sum_s dot4(ws[s], xh[s]) + sum_s dot4(ws[s], xl[s]) per int32 lane (two activation digits; dp: an ISA's
    dot4 accumulator, `(e, acc, w, x)`), or with xl None (one digit) sum_s dot4(ws[s], xh[s]): with AVX2's,
    _dp2_avx2; else dp's chain, the hi digits, a shift by 8, the lo digits. The decode row dot takes one vector
    (s < 1), simd_lanes.py's kernel Tv."""
    if dp is _dp_avx2:
        return _dp2_avx2(e, ws, xh, xl)
    t = ir.Constant(V(I32, 16), [0] * 16)
    for w, x in zip(ws, xh):
        t = dp(e, t, w, x)
    if xl is None:
        return t
    t = e.b.shl(t, ir.Constant(V(I32, 16), [8] * 16))
    for w, x in zip(ws, xl):
        t = dp(e, t, w, x)
    return t


def _q4_k_weights(e, wb, blk):
    """A Q4_K super-block's scales, computed once per block when several tokens share the row (_row_intrinsic's
    n_tok): (d, dmin, scales, mins, wb, blk). Each token's part loads the nibbles where it uses them: loading them
    here kept 8 more AVX2 registers live (2026-12-07: a 15% slower MoE decode); LLVM shares the repeated loads."""
    # block_q4_K: d, dmin, scales[12], qs[128]; qs[32c + l] holds element l of sub-block 2c (low nibble) and
    # of sub-block 2c + 1 (high nibble)
    d, dmin = e.f16x2(wb, blk)
    scales, mins = _k4_scales(e, wb, e.off(blk, 4))
    return d, dmin, scales, mins, wb, blk


def _q4_k_token(e, W, xdb, dxb, xsb, b, accs, digits=2, dp=_dp_vnni):
    """One token's part of the Q4_K digit row dot, on _q4_k_weights' values W. digits = 1: x as one int8 digit per
    element (digits32 into a uint8 buffer: SB_BYTES1 per super-block), one vpdpbusd per 64 weights instead of two
    and a shift."""
    bb = e.b
    d, dmin, scales, mins, wb, blk = W
    dx8 = e.load(dxb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    sdx = bb.fmul(bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8))), dx8)
    xb = bb.mul(b, ir.Constant(I64, SB_BYTES if digits == 2 else SB_BYTES1))
    zero = ir.Constant(V(I32, 16), [0] * 16)
    new = []
    for h in range(2):
        q = e.load(wb, e.off(blk, 16 + 64 * h), V(I8, 64))
        for n, wv in enumerate((bb.and_(q, e.const(I8, 64, 15)), bb.lshr(q, e.const(I8, 64, 4)))):
            if digits == 1:
                t = dp(e, zero, wv, e.load(xdb, e.off(xb, 128 * h + 64 * n), V(I8, 64)))
            else:
                at = 256 * h + 128 * n
                xh = e.load(xdb, e.off(xb, at), V(I8, 64))
                xl = e.load(xdb, e.off(xb, at + 64), V(I8, 64))
                t = _digits_dot(e, dp, [wv], [xh], [xl])
            # lane i: sub-block 2 * (2h + i // 8) + n
            scl = e.shuffle(sdx, sdx, [2 * (2 * h + i // 8) + n for i in range(16)])
            new.append(e.fma(accs[2 * h + n], bb.sitofp(t, V(F32, 16)), scl))
    new.append(_kquant_mins(e, xsb, b, dmin, mins, accs[4]))
    return new


def q4_k_body(digits, dp):
    """The Q4_K digit row dot's per-block body, split into its weights' part and a token's (SplitBody)."""
    return SplitBody(_q4_k_weights, partial(_q4_k_token, digits=digits, dp=dp))


DOTS = {"vnni": _dp_vnni, "avx2": _dp_avx2}


def row_dots(isa):
    """Q4_K digit row dots (digit_dots) with `isa`'s 4-product sums. xq's dtype picks the body: int8 = two
    digits per element; uint8 = one (the buffer's bytes typed uint8, holding int8 digits: the dtype tells the
    kernels apart). 4 scale-lane accumulators + the mins."""
    bodies = {
        types.int8: q4_k_body(2, DOTS[isa]),
        types.uint8: q4_k_body(1, DOTS[isa]),
    }
    return digit_dots(bodies)


def digit_dots(bodies):
    """The Q4_K digit row dots over `bodies` (activation dtype -> body): one row; two rows; two rows with two
    tokens; with three (simd._row_intrinsic's n_tok)."""
    make = partial(_row_intrinsic, 144, bodies, 2, n_vec=4)
    return make(), make(n_rows=2), make(n_rows=2, n_tok=2), make(n_rows=2, n_tok=3)


# The decode's choice between these and simd_avx2.py's folded AVX2 body: simd_avx2.q4_k_digit_dot.


# ---- activation digits: one 32-element group per call, vectorized -------------------------------------


def store_digits(e, xdb, g, digits, q, hi, lo):
    """Group g's digits (hi and lo, or q alone) at their digit_offset bytes of the buffer at xdb (SB_BYTES or
    SB_BYTES1 per super-block)."""
    bb = e.b
    c = lambda k: ir.Constant(I64, k)  # noqa: E731
    sb = SB_BYTES if digits == 2 else SB_BYTES1
    j = bb.and_(g, c(7))
    at = bb.add(bb.mul(bb.lshr(g, c(3)), c(sb)), bb.mul(bb.lshr(j, c(2)), c(128 * digits)))
    at = bb.add(at, bb.add(bb.mul(bb.and_(j, c(1)), c(64 * digits)), bb.mul(bb.and_(bb.lshr(j, c(1)), c(1)), c(32))))
    for k, v in enumerate((hi, lo) if digits == 2 else (q,)):
        bb.store(bb.trunc(v, V(I8, 32)), e.ptr(xdb, e.off(at, 64 * k), V(I8, 32)), align=1)


def buffer_digits(x, xd, dx, xs):
    """A quantizer's argument types -> the digits per element its buffer xd holds: int8, two; uint8, one; None if
    they are not (x, dx, xs C-contiguous float32 and xd one of those)."""
    if not (_c_array(x, types.float32) and _c_array(dx, types.float32) and _c_array(xs, types.float32)):
        return None
    if _c_array(xd, types.int8):
        return 2
    return 1 if _c_array(xd, types.uint8) else None


def _digits_intrinsic(shared, name):
    """Intrinsic `(x, xd, dx, xs, b)`: super-block b (elements 256b..256b+255) of x, group by group (g = 8b + k):
    dx[g] = max|x| / L, xs[g] (group_digits), and q = rint(x / dx[g]) (0 if the group is all zero) at
    digit_offset(e, digits) of xd. xd's type decides how many digits, when the kernel is compiled: int8, two
    (L = XD_MAX, q = 256 hi + lo, the default decode row dots); uint8, one (L = XD1_MAX, q itself: the one-digit
    buffer, int8.DIGITS == 1). shared: with two digits, max|x| is taken over the super-block and its dx stored in
    all 8 groups' slots (simd_avx2.py's folded body); else, and with one digit, per group."""

    def typer(typingctx, x, xd, dx, xs, b):
        digits = buffer_digits(x, xd, dx, xs)
        if digits is None:
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            bb = builder
            xb, xdb, dxb, xsb = (e.base(sig.args[i], a) for i, a in enumerate(args[:4]))
            g0 = bb.mul(args[4], ir.Constant(I64, 8))
            amax = None
            if shared and digits == 2:
                m = None
                for k in range(8):
                    a = _vcall(e, "llvm.fabs", e.load(xb, bb.mul(e.off(g0, k), ir.Constant(I64, 128)), V(F32, 32), 4))
                    m = a if m is None else bb.select(bb.fcmp_ordered(">", a, m), a, m)
                amax = abs_max(e, m)
            for k in range(8):
                g = e.off(g0, k)
                q, hi, lo = group_digits(e, xb, dxb, xsb, g, XD_MAX if digits == 2 else XD1_MAX, amax)
                store_digits(e, xdb, g, digits, q, hi, lo)
            return context.get_dummy_value()

        return types.none(x, xd, dx, xs, types.int64), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


# digits32(x, xd, dx, xs, b): super-block b's digits with a scale per 32 elements (the vpdpbusd bodies' grid);
# digits256: with two digits one scale per super-block (simd_avx2.py's grid), with one per 32 as digits32.
digits32 = _digits_intrinsic(False, "digits32")
digits256 = _digits_intrinsic(True, "digits256")
