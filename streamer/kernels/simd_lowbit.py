"""Row dots and exact dequantization of the low-bit formats real large-MoE GGUFs use: Q2_K, Q3_K (256-element
super-blocks of 16 sub-blocks of 16), IQ4_XS (256: 8 sub-blocks of 32 on the IQ4_NL non-linear grid), and
the 32-element IQ4_NL (same grid), Q4_1, Q5_0, Q5_1 and MXFP4, in simd.py's vector-IR style and call signatures.

Layouts (ggml-common.h), element e of a super-block in the order ggml's dequantize_row_* writes it:
- block_q2_K {uint8 scales[16]; uint8 qs[64]; half d; half dmin} (84 bytes). e = 128h + 32j + l (h < 2,
  j < 4, l < 32): q = (qs[32h + l] >> 2j) & 3; sub-block s = e / 16, scale byte sc = scales[s];
  value d * (sc & 15) * q - dmin * (sc >> 4).
- block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d} (110 bytes). Same e, l, h, j: low bits
  (qs[32h + l] >> 2j) & 3, minus 4 unless bit 4h + j of hmask[l] is set; 16 six-bit scales packed in 12 bytes
  (low nibbles in bytes 0-7, then high nibbles; top 2 bits in bytes 8-11), value d * (scale - 32) * q.
- block_iq4_xs {half d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]} (136 bytes). Sub-block b < 8 of
  32: element l < 16 is the low nibble of qs[16b + l], l + 16 its high nibble, each an index into the 16
  kvalues; 6-bit scale ((scales_l[b/2] >> 4(b%2)) & 15) | ((scales_h >> 2b) & 3) << 4; value
  d * (scale - 32) * kvalues[index].
- block_iq4_nl {half d; uint8 qs[16]} (18 bytes): element l < 16 low nibble, l + 16 high nibble; d * kvalues[i].
- block_q4_1 {half d; half m; uint8 qs[16]} (20 bytes): nibbles as IQ4_NL, value d * q + m.
- block_q5_0 {half d; uint32 qh; uint8 qs[16]} (22 bytes): bit k of qh is bit 4 of element k; d * (q - 16).
- block_q5_1 {half d; half m; uint32 qh; uint8 qs[16]} (24 bytes): as Q5_0 without the -16, value d * q + m.
- block_mxfp4 {uint8 e; uint8 qs[16]} (17 bytes): nibbles as IQ4_NL, each an E2M1 value (kept doubled, as
  ggml's kvalues_mxfp4), times the E8M0 scale 2^(e - 127) halved.
The row dots multiply the int16 activations by (scale * q) as int16 and sum pairs into int32 (simd.pairdot);
the Q2_K mins use exact f32 sums of x per 16 elements (ggml's bsums, in float; blocks.prepare writes them), the
Q4_1/Q5_1 mins exact f32 sums of x per block (prepared as for the K-quants).
"""

from llvmlite import ir

from . import cpu
from .simd import F32, I8, I16, I32, I64, V, _deq_intrinsic, _row_intrinsic

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml kvalues_iq4nl
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 values doubled (kvalues_mxfp4)
_PSHUFB = cpu.has("ssse3")


def _lookup(e, idx, values=KVALUES):
    """values[idx] for a <32 x i8> of indices 0..15, as <32 x i8> (pshufb on x86; lane by lane elsewhere)."""
    bb = e.b
    table = ir.Constant(V(I8, 16), list(values))
    if _PSHUFB:
        fn = e.declare("llvm.x86.ssse3.pshuf.b.128", V(I8, 16), [V(I8, 16), V(I8, 16)])
        lo = bb.call(fn, [table, e.shuffle(idx, idx, list(range(16)))])
        hi = bb.call(fn, [table, e.shuffle(idx, idx, list(range(16, 32)))])
        return e.shuffle(lo, hi, list(range(32)))
    out = ir.Constant(V(I8, 32), ir.Undefined)
    for k in range(32):
        out = bb.insert_element(out, bb.extract_element(table, bb.extract_element(idx, I32(k))), I32(k))
    return out


def _x(e, xqb, b, first):
    """<32 x i16> activations first.. of super-block b (256 int16 per super-block)."""
    return e.load(xqb, e.off(e.b.mul(b, ir.Constant(I64, 512)), 2 * first), V(I16, 32), 2)


def _dx(e, dxb, b):
    return e.load(dxb, e.b.mul(b, ir.Constant(I64, 4)), F32, 4)


def _two_scales(e, v16, g):
    """<32 x ...>: sub-block g's value for elements 0-15, g + 1's for 16-31."""
    return e.shuffle(v16, v16, [g] * 16 + [g + 1] * 16)


# ---- Q2_K ----
def _q2_k_values(e, wb, blk):
    """(h, j, <32 x i8> q in 0..3) for elements 128h + 32j .. +31."""
    bb = e.b
    for h in range(2):
        q = e.load(wb, e.off(blk, 16 + 32 * h), V(I8, 32))
        for j in range(4):
            yield h, j, bb.and_(bb.lshr(q, e.const(I8, 32, 2 * j)), e.const(I8, 32, 3))


def _q2_k(e, wb, xqb, dxb, xsb, b, blk, accs):
    # The 2-bit fields are widened to words once per 32 bytes; each is then a shift and a mask, its scale a word
    # shuffle. The mins need no pass over x: sum_s dmin * m_s * (exact f32 sum of x over sub-block s), from the
    # per-16 sums blocks.prepare writes for Q2_K.
    bb = e.b
    sc = bb.zext(e.load(wb, blk, V(I8, 16)), V(I16, 16))
    lo = bb.and_(sc, e.const(I16, 16, 15))
    isum = ir.Constant(V(I32, 16), [0] * 16)
    for h in range(2):
        qw = bb.zext(e.load(wb, e.off(blk, 16 + 32 * h), V(I8, 32)), V(I16, 32))
        for j in range(4):
            q = bb.and_(bb.lshr(qw, e.const(I16, 32, 2 * j)), e.const(I16, 32, 3))
            w = bb.mul(q, _two_scales(e, lo, 8 * h + 2 * j))
            isum = bb.add(isum, e.pairdot(w, _x(e, xqb, b, 128 * h + 32 * j)))
    d, dmin = e.f16x2(wb, e.off(blk, 80))
    acc = e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(bb.fmul(d, _dx(e, dxb, b)), 16))
    mins = bb.uitofp(bb.lshr(sc, e.const(I16, 16, 4)), V(F32, 16))
    xs16 = e.load(xsb, bb.mul(b, ir.Constant(I64, 64)), V(F32, 16), 4)
    return [e.fma(acc, bb.fmul(mins, xs16), e.splat(bb.fsub(ir.Constant(F32, 0.0), dmin), 16))]


def _deq_q2_k(e, wb, blk, store):
    bb = e.b
    d, dmin = e.f16x2(wb, e.off(blk, 80))
    sc = e.load(wb, blk, V(I8, 16))
    dl = bb.fmul(e.splat(d, 16), bb.uitofp(bb.and_(sc, e.const(I8, 16, 15)), V(F32, 16)))
    ml = bb.fmul(e.splat(dmin, 16), bb.uitofp(bb.lshr(sc, e.const(I8, 16, 4)), V(F32, 16)))
    for h, j, q in _q2_k_values(e, wb, blk):
        g = 8 * h + 2 * j
        store(
            128 * h + 32 * j, bb.fsub(bb.fmul(_two_scales(e, dl, g), bb.uitofp(q, V(F32, 32))), _two_scales(e, ml, g))
        )


# ---- Q3_K ----
def _q3_k_scales(e, wb, blk):
    """The 16 signed scales (6-bit value - 32) as <16 x i8>, ggml's kmask unpacking of bytes 96..107."""
    bb = e.b
    u0, u1, tmp = (e.load(wb, e.off(blk, 96 + k), I32) for k in (0, 4, 8))
    m4, m2 = I32(0x0F0F0F0F), I32(0x03030303)

    def part(low, shift):
        return bb.or_(bb.and_(low, m4), bb.shl(bb.and_(bb.lshr(tmp, I32(shift)), m2), I32(4)))

    words = (part(u0, 0), part(u1, 2), part(bb.lshr(u0, I32(4)), 4), part(bb.lshr(u1, I32(4)), 6))
    v = ir.Constant(V(I32, 4), ir.Undefined)
    for k, w in enumerate(words):
        v = bb.insert_element(v, w, I32(k))
    return bb.sub(bb.bitcast(v, V(I8, 16)), e.const(I8, 16, 32))


def _q3_k_values(e, wb, blk):
    """(h, j, <32 x i8> q in -4..3) for elements 128h + 32j .. +31."""
    bb = e.b
    hm = e.load(wb, blk, V(I8, 32))
    for h in range(2):
        q = e.load(wb, e.off(blk, 32 + 32 * h), V(I8, 32))
        for j in range(4):
            low = bb.and_(bb.lshr(q, e.const(I8, 32, 2 * j)), e.const(I8, 32, 3))
            hbit = bb.and_(bb.lshr(hm, e.const(I8, 32, 4 * h + j)), e.const(I8, 32, 1))  # 1: no offset
            yield h, j, bb.sub(low, bb.shl(bb.xor(hbit, e.const(I8, 32, 1)), e.const(I8, 32, 2)))


def _q3_k(e, wb, xqb, dxb, xsb, b, blk, accs):
    bb = e.b
    sc = e.opaque(bb.sext(_q3_k_scales(e, wb, blk), V(I16, 16)))
    isum = ir.Constant(V(I32, 16), [0] * 16)
    for h, j, q in _q3_k_values(e, wb, blk):
        w = bb.mul(bb.sext(q, V(I16, 32)), _two_scales(e, sc, 8 * h + 2 * j))
        isum = bb.add(isum, e.pairdot(w, _x(e, xqb, b, 128 * h + 32 * j)))
    d = e.f16x2(wb, e.off(blk, 106))[1]  # the half at 108, read without going past the block's end
    return [e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(bb.fmul(d, _dx(e, dxb, b)), 16))]


def _deq_q3_k(e, wb, blk, store):
    bb = e.b
    d = e.f16x2(wb, e.off(blk, 106))[1]
    dl = bb.fmul(e.splat(d, 16), bb.sitofp(_q3_k_scales(e, wb, blk), V(F32, 16)))
    for h, j, q in _q3_k_values(e, wb, blk):
        store(128 * h + 32 * j, bb.fmul(_two_scales(e, dl, 8 * h + 2 * j), bb.sitofp(q, V(F32, 32))))


# ---- IQ4_XS, IQ4_NL ----
def _nl_values(e, wb, at, values=KVALUES):
    """<32 x i8> grid values of the 16 bytes at `at`: low nibbles are elements 0-15, high nibbles 16-31."""
    bb = e.b
    q = e.load(wb, at, V(I8, 16))
    idx = e.shuffle(bb.and_(q, e.const(I8, 16, 15)), bb.lshr(q, e.const(I8, 16, 4)), list(range(32)))
    return _lookup(e, idx, values)


def _iq4_xs_scales(e, wb, blk):
    """The 8 signed sub-block scales (6-bit value - 32), as i32 values."""
    bb = e.b
    sh = bb.zext(e.load(wb, e.off(blk, 2), I16), I32)
    sl = e.load(wb, e.off(blk, 4), I32)
    out = []
    for k in range(8):
        lo = bb.and_(bb.lshr(sl, I32(4 * k)), I32(15))
        hi = bb.and_(bb.lshr(sh, I32(2 * k)), I32(3))
        out.append(bb.sub(bb.or_(lo, bb.shl(hi, I32(4))), I32(32)))
    return out


def _iq4_xs(e, wb, xqb, dxb, xsb, b, blk, accs):
    bb = e.b
    isum = ir.Constant(V(I32, 16), [0] * 16)
    for k, s in enumerate(_iq4_xs_scales(e, wb, blk)):
        w = bb.mul(bb.sext(_nl_values(e, wb, e.off(blk, 8 + 16 * k)), V(I16, 32)), e.splat(bb.trunc(s, I16), 32))
        isum = bb.add(isum, e.pairdot(w, _x(e, xqb, b, 32 * k)))
    d = e.f16x2(wb, blk)[0]
    return [e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(bb.fmul(d, _dx(e, dxb, b)), 16))]


def _deq_iq4_xs(e, wb, blk, store):
    bb = e.b
    d = e.f16x2(wb, blk)[0]
    for k, s in enumerate(_iq4_xs_scales(e, wb, blk)):
        dl = bb.fmul(d, bb.sitofp(s, F32))
        store(32 * k, bb.fmul(e.splat(dl, 32), bb.sitofp(_nl_values(e, wb, e.off(blk, 8 + 16 * k)), V(F32, 32))))


def _iq4_nl(e, wb, xqb, dxb, xsb, b, blk, accs):
    # 32-element blocks: x is quantized per 32 (dx[b]), as for Q8_0/Q4_0
    bb = e.b
    w = bb.sext(_nl_values(e, wb, e.off(blk, 2)), V(I16, 32))
    xv = e.load(xqb, bb.mul(b, ir.Constant(I64, 64)), V(I16, 32), 2)
    s = bb.fmul(e.f16x2(wb, blk)[0], _dx(e, dxb, b))
    return [e.fma(accs[0], bb.sitofp(e.pairdot(w, xv), V(F32, 16)), e.splat(s, 16))]


def _deq_iq4_nl(e, wb, blk, store):
    bb = e.b
    store(0, bb.fmul(e.splat(e.f16x2(wb, blk)[0], 32), bb.sitofp(_nl_values(e, wb, e.off(blk, 2)), V(F32, 32))))


# ---- Q4_1, Q5_0, Q5_1: 32-element blocks ----
def _nibbles(e, wb, at):
    """<32 x i8> 0..15: low nibbles of the 16 bytes at `at` are elements 0-15, high nibbles 16-31."""
    bb = e.b
    q = e.load(wb, at, V(I8, 16))
    return e.shuffle(bb.and_(q, e.const(I8, 16, 15)), bb.lshr(q, e.const(I8, 16, 4)), list(range(32)))


def _fifth_bits(e, wb, at):
    """<32 x i8> 0 or 16: bit k of the little-endian u32 at `at` is element k's fifth bit."""
    bb = e.b
    bits = bb.bitcast(e.load(wb, at, I32), V(ir.IntType(1), 32))
    return bb.shl(bb.zext(bits, V(I8, 32)), e.const(I8, 32, 4))


def _q4_1_values(e, wb, blk):
    return _nibbles(e, wb, e.off(blk, 4))


def _q5_0_values(e, wb, blk):
    bb = e.b
    return bb.sub(bb.or_(_nibbles(e, wb, e.off(blk, 6)), _fifth_bits(e, wb, e.off(blk, 2))), e.const(I8, 32, 16))


def _q5_1_values(e, wb, blk):
    return e.b.or_(_nibbles(e, wb, e.off(blk, 8)), _fifth_bits(e, wb, e.off(blk, 4)))


def _block32(values, has_min):
    """Row dot of a 32-element format: d * dx * sum(q * xq) [+ m * (exact f32 sum of x over the block)]."""

    def body(e, wb, xqb, dxb, xsb, b, blk, accs):
        bb = e.b
        w = bb.sext(values(e, wb, blk), V(I16, 32))
        xv = e.load(xqb, bb.mul(b, ir.Constant(I64, 64)), V(I16, 32), 2)
        d, m = e.f16x2(wb, blk)
        acc = e.fma(accs[0], bb.sitofp(e.pairdot(w, xv), V(F32, 16)), e.splat(bb.fmul(d, _dx(e, dxb, b)), 16))
        if has_min:
            mx = bb.fmul(m, e.load(xsb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
            acc = bb.fadd(acc, bb.insert_element(ir.Constant(V(F32, 16), [0.0] * 16), mx, I32(0)))
        return [acc]

    return body


def _deq_block32(values, has_min):
    def body(e, wb, blk, store):
        bb = e.b
        d, m = e.f16x2(wb, blk)
        y = bb.fmul(e.splat(d, 32), bb.sitofp(values(e, wb, blk), V(F32, 32)))
        store(0, bb.fadd(y, e.splat(m, 32)) if has_min else y)

    return body


# ---- MXFP4 ----
def _e8m0_half(e, wb, blk):
    """ggml_e8m0_to_fp32_half of the scale byte: 2^(x - 128) as f32 bits (subnormal for x < 2)."""
    bb = e.b
    x = bb.zext(e.load(wb, blk, I8), I32)
    bits = bb.select(bb.icmp_unsigned("<", x, I32(2)), bb.shl(I32(0x00200000), x), bb.shl(bb.sub(x, I32(1)), I32(23)))
    return bb.bitcast(bits, F32)


def _mxfp4(e, wb, xqb, dxb, xsb, b, blk, accs):
    bb = e.b
    w = bb.sext(_nl_values(e, wb, e.off(blk, 1), KVALUES_MXFP4), V(I16, 32))
    xv = e.load(xqb, bb.mul(b, ir.Constant(I64, 64)), V(I16, 32), 2)
    s = bb.fmul(_e8m0_half(e, wb, blk), _dx(e, dxb, b))
    return [e.fma(accs[0], bb.sitofp(e.pairdot(w, xv), V(F32, 16)), e.splat(s, 16))]


def _deq_mxfp4(e, wb, blk, store):
    bb = e.b
    v = bb.sitofp(_nl_values(e, wb, e.off(blk, 1), KVALUES_MXFP4), V(F32, 32))
    store(0, bb.fmul(e.splat(_e8m0_half(e, wb, blk), 32), v))


mxfp4_dot = _row_intrinsic(17, _mxfp4, 1)
mxfp4_deq = _deq_intrinsic(17, 32, _deq_mxfp4)
q4_1_dot = _row_intrinsic(20, _block32(_q4_1_values, True), 1)
q5_0_dot = _row_intrinsic(22, _block32(_q5_0_values, False), 1)
q5_1_dot = _row_intrinsic(24, _block32(_q5_1_values, True), 1)
q4_1_deq = _deq_intrinsic(20, 32, _deq_block32(_q4_1_values, True))
q5_0_deq = _deq_intrinsic(22, 32, _deq_block32(_q5_0_values, False))
q5_1_deq = _deq_intrinsic(24, 32, _deq_block32(_q5_1_values, True))
q2_k_dot = _row_intrinsic(84, _q2_k, 1)
q3_k_dot = _row_intrinsic(110, _q3_k, 1)
iq4_xs_dot = _row_intrinsic(136, _iq4_xs, 1)
iq4_nl_dot = _row_intrinsic(18, _iq4_nl, 1)
q2_k_deq = _deq_intrinsic(84, 256, _deq_q2_k)
q3_k_deq = _deq_intrinsic(110, 256, _deq_q3_k)
iq4_xs_deq = _deq_intrinsic(136, 256, _deq_iq4_xs)
iq4_nl_deq = _deq_intrinsic(18, 32, _deq_iq4_nl)
