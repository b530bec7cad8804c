"""The Q4_K decode row dot where the CPU has AVX2 but not AVX512-VNNI: two activation digits, one activation scale per
256-element super-block, and the sub-block scales folded into vpmaddwd.

simd_vnni.py's bodies apply each sub-block's scale per int32 lane in f32 (a cvt, a broadcast and an fma per 32 weights).
On AVX2 the vpmaddwd that widens the pair sums can multiply them by the sub-block scale instead of by 1 (sc_j <= 63:
exact), if the activation scale is the same across the super-block. So here dx is one per super-block
(simd_vnni.digits256: stored in all 8 of its groups' slots, so the layout is simd_vnni's), and per super-block
    isum = 256 * sum_j sc_j sum(u * hi) + sum_j sc_j sum(u * lo)   (u = nibble <= 15, per int32 lane),
exact in int32 (< 2^30); one cvt and one fma per 8 lanes per super-block: acc += float(isum) * (d dx). The mins are
simd_vnni's (exact f32 sums of x per 32).

Accuracy: the activation grid is (256, XD_MAX): 2x finer levels than the int16 path's (256, 16383), 8x coarser groups
than simd_vnni's (32, XD_MAX); the bound of simd_vnni.py's docstring with that grid (tests/test_decode_digits.py).

One digit (the default on AVX2, or STREAM_RUN_ACT=int8; the buffer's bytes typed uint8) keeps simd_vnni's grid and
layout, and sums each sub-block's products in integers before one conversion per super-block (_q4_k_sum_token)
(2026-12-07: 7% less decode MoE time than simd_vnni's AVX2 body)."""

from llvmlite import ir
from numba import types

from .int8 import host_has_vnni
from .simd import F32, I8, I16, I32, I64, SplitBody, V, _k4_scales, _kquant_mins
from .simd_vnni import SB_BYTES, SB_BYTES1, digit_dots, digits32, digits256, row_dots


def _q4_k_fold_body(e, wb, xdb, dxb, xsb, b, blk, accs):
    # block_q4_K: d, dmin, scales[12], qs[128]; qs[32c + l] holds element l of sub-block 2c (low nibble) and of
    # sub-block 2c + 1 (high nibble). x: simd_vnni's two-digit layout, dx[8b] the super-block's scale.
    bb = e.b
    mub = e.declare("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [V(I8, 32), V(I8, 32)])
    mwd = e.declare("llvm.x86.avx2.pmadd.wd", V(I32, 8), [V(I16, 16), V(I16, 16)])
    d, dmin = e.f16x2(wb, blk)
    scales, mins = _k4_scales(e, wb, e.off(blk, 4))
    # the 8 scales as words in both 128-bit halves: each sub-block's multiplier is one in-lane shuffle (vpshufb)
    s16 = bb.zext(e.shuffle(scales, scales, list(range(8)) * 2), V(I16, 16))
    xb = bb.mul(b, ir.Constant(I64, SB_BYTES))
    acc = {}
    for h in range(2):
        q = e.load(wb, e.off(blk, 16 + 64 * h), V(I8, 64))
        for n, wv in enumerate((bb.and_(q, e.const(I8, 64, 15)), bb.lshr(q, e.const(I8, 64, 4)))):
            at = 256 * h + 128 * n
            xh = e.load(xdb, e.off(xb, at), V(I8, 64))
            xl = e.load(xdb, e.off(xb, at + 64), V(I8, 64))
            for k in range(2):  # 32 bytes each: sub-block 2 (2h + k) + n
                j = 2 * (2 * h + k) + n
                half = list(range(32 * k, 32 * k + 32))
                w32 = e.shuffle(wv, wv, half)
                sc = e.shuffle(s16, s16, [j] * 8 + [8 + j] * 8)
                for digit, xv in enumerate((xh, xl)):
                    t = bb.call(mwd, [bb.call(mub, [w32, e.shuffle(xv, xv, half)]), sc])
                    key = (digit, h)  # h: two independent chains per digit
                    acc[key] = bb.add(acc[key], t) if key in acc else t
    hi = e.shuffle(acc[0, 0], acc[0, 1], list(range(16)))
    lo = e.shuffle(acc[1, 0], acc[1, 1], list(range(16)))
    isum = bb.add(bb.shl(hi, e.const(I32, 16, 8)), lo)
    dx = e.load(dxb, bb.mul(b, ir.Constant(I64, 32)), F32, 4)
    new = e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(bb.fmul(d, dx), 16))
    return [new, _kquant_mins(e, xsb, b, dmin, mins, accs[1])]


def _q4_k_sum_weights(e, wb, blk):
    """_q4_k_sum_token's values from the weights alone, once per block: (d * sc_j as f32 x 8, dmin, the mins as
    f32 x 8, wb, blk)."""
    bb = e.b
    d, dmin = e.f16x2(wb, blk)
    scales, mins = _k4_scales(e, wb, e.off(blk, 4))
    dsc = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
    return dsc, dmin, bb.uitofp(mins, V(F32, 8)), wb, blk


def _q4_k_sum_token(e, W, xdb, dxb, xsb, b, accs):
    """One token's part of the one-digit Q4_K row dot on AVX2 (x: digits32's one-digit layout, a scale per 32). Each
    sub-block's 32 products are summed in integers (vpmaddubsw, then vphaddw across the 8 sub-blocks), then one fma
    for all 8: acc lanes 0-7 += float(isum_j) * (d sc_j dx_j), lanes 8-15 += (m_j xs_j) * -dmin; the row's value is
    the sum of the 16 lanes. Within simd_vnni.py's bound, its bits only to float32 rounding."""
    bb = e.b
    dsc, dmin, mf, wb, blk = W
    mub = e.declare("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [V(I8, 32), V(I8, 32)])
    hadd = e.declare("llvm.x86.avx2.phadd.w", V(I16, 16), [V(I16, 16), V(I16, 16)])
    xb = bb.mul(b, ir.Constant(I64, SB_BYTES1))
    sub = [None] * 8
    for h in range(2):
        q = e.load(wb, e.off(blk, 16 + 64 * h), V(I8, 64))
        for n, wv in enumerate((bb.and_(q, e.const(I8, 64, 15)), bb.lshr(q, e.const(I8, 64, 4)))):
            xv = e.load(xdb, e.off(xb, 128 * h + 64 * n), V(I8, 64))
            for k in range(2):  # 32 bytes each: sub-block 2 (2h + k) + n
                half = list(range(32 * k, 32 * k + 32))
                sub[2 * (2 * h + k) + n] = bb.call(mub, [e.shuffle(wv, wv, half), e.shuffle(xv, xv, half)])
    # vphaddw works per 128-bit half: after three rounds, word j of half c is sub-block j's sum over that half's
    # 16 products (|.| <= 16 * 15 * 127 < 2^15: exact in int16); the halves are added in int32
    a = [bb.call(hadd, [sub[2 * i], sub[2 * i + 1]]) for i in range(4)]
    t = bb.call(hadd, [bb.call(hadd, [a[0], a[1]]), bb.call(hadd, [a[2], a[3]])])
    wide = bb.sext(t, V(I32, 16))
    isum = bb.add(e.shuffle(wide, wide, list(range(8))), e.shuffle(wide, wide, list(range(8, 16))))
    dx8 = e.load(dxb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    xs8 = e.load(xsb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    vals = e.shuffle(bb.sitofp(isum, V(F32, 8)), bb.fmul(mf, xs8), list(range(16)))
    scl = e.shuffle(bb.fmul(dsc, dx8), bb.fneg(e.splat(dmin, 8)), list(range(16)))
    return [e.fma(accs[0], vals, scl), accs[1]]


def fold_row_dots():
    """Q4_K digit row dots (simd_vnni.digit_dots) for AVX2: the folded body for two digits (int8 buffer), the
    summed one (_q4_k_sum_token) for one (uint8)."""
    bodies = {
        types.int8: (_q4_k_fold_body, 1),  # one accumulator (+ the mins'), the one-digit body 4
        types.uint8: (SplitBody(_q4_k_sum_weights, _q4_k_sum_token), 1),
    }
    return digit_dots(bodies)


# act_digits(x, xq, dx, xs, b): the decode's quantizer, super-block b into xq by the kernels' grid: with two digits
# (int8 xq) one scale per 256 where FOLD (simd_vnni.digits256), else per 32 (digits32); one digit (uint8) per 32.
FOLD = not host_has_vnni()
act_digits = digits256 if FOLD else digits32

# The decode's Q4_K digit row dots: vpdpbusd where the CPU has it, else the folded AVX2 body. int8.decode_isa
# decides whether they run at all.
q4_k_digit_dot, q4_k_digit_dot2, q4_k_digit_dot2x2, q4_k_digit_dot2x3 = fold_row_dots() if FOLD else row_dots("vnni")
