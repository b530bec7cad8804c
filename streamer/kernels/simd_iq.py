"""Row dots and exact dequantization of the i-quant grid formats: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ1_S, IQ1_M (256-element super-blocks), in simd.py's vector-IR style and call signatures.

Every one of them stores, per group of 8 (or 4) elements, an index into a fixed grid of small unsigned
values, 8 sign bits per group of 8, and a 4-bit scale s per 16 or 32 elements; an element is
d * (2s + 1) * grid value * sign * factor (factor 1/8 for IQ2, 1/4 for IQ3_XXS, 1 for IQ3_S, so
d * (0.5 + s) * 0.25, d * (0.5 + s) * 0.5 and d * (1 + 2s) as ggml writes them). Here (2s + 1) * grid * sign
is formed as an int16 per element (|.| <= 31 * 62), 32 at a time: the row dot pairs it with the int16
activations into int32 (simd.pairdot), and dequantization multiplies it by d * factor, which is exact (so
the values equal ggml's and gguf-py's bit for bit). The grids are ggml-common.h's tables as gguf-py carries
them; ggml's ksigns table is i | parity(i) << 7, computed.

Layouts (ggml-common.h), offsets in bytes:
- block_iq2_xxs {half d; uint16 qs[32]} (66): sub-block k < 8 of 32 is two u32 at 2 + 8k: the first holds
  4 grid indices (bytes), the second 4 seven-bit sign indices (bits 7l..7l+6) and s in its top 4 bits.
- block_iq2_xs {half d; uint16 qs[32]; uint8 scales[8]} (74): group g < 32 of 8 is qs[g]: grid index
  qs & 511, sign index qs >> 9; scale of elements 32k..32k+15 scales[k] & 15, of the next 16 scales[k] >> 4.
- block_iq2_s {half d; uint8 qs[32]; uint8 signs[32]; uint8 qh[8]; uint8 scales[8]} (82): group g: grid
  index qs[g] | ((qh[g/4] >> 2(g%4)) & 3) << 8 into 1024 entries, sign byte signs[g]; scales as IQ2_XS.
- block_iq3_xxs {half d; uint8 qs[64]; uint32 scales_and_signs[8]} (98): groups of 4 grid values (256
  entries of 4) indexed by qs; sub-block k: u32 at 66 + 4k with 4 seven-bit sign indices and s on top.
- block_iq3_s {half d; uint8 qs[64]; uint8 qh[8]; uint8 signs[32]; uint8 scales[4]} (110): quad q: grid
  index qs[q] | ((qh[q/8] >> (q%8)) & 1) << 8 into 512 entries of 4; group g of 8 signs[g]; sub-block k's
  scale (scales[k/2] >> 4(k%2)) & 15.
- block_iq1_s {half d; uint8 qs[32]; uint16 qh[8]} (50): group g of 8: index qs[g] | ((qh[g/4] >> 3(g%4)) & 7)
  << 8 into 2048 rows of -1/0/1; sub-block k: 3-bit s = (qh[k] >> 12) & 7, and delta -1/8 if bit 15 of qh[k]
  is set, else +1/8; value d * (2s + 1) * (grid + delta), formed here as (2s + 1) * (8 grid +- 1) times d/8.
- block_iq1_m {uint8 qs[32]; uint8 qh[16]; uint16 scales[4]} (56): group g: index qs[g] | (nibble_g & 7) << 8,
  nibble_g = qh[g/2] >> 4(g%2), delta sign from its bit 3; 3-bit scale per 16 elements j: (scales[j/4] >>
  3(j%4)) & 7; the f16 d is the four top nibbles of scales[0..3] (lowest first).
"""

import numpy as np
from gguf import quants
from llvmlite import ir

from .simd import F32, I8, I16, I32, I64, V, _deq_intrinsic, _row_intrinsic


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.int8).view(np.uint8)  # IQ1 grids hold -1, 0, 1


_GRIDS = {
    "iq2xxs": _grid(quants.IQ2_XXS),
    "iq2xs": _grid(quants.IQ2_XS),
    "iq2s": _grid(quants.IQ2_S),
    "iq3xxs": _grid(quants.IQ3_XXS),
    "iq3s": _grid(quants.IQ3_S),
    "iq1s": _grid(quants.IQ1_S),
}


def _table(e, name):
    """The grid `name` as a constant global of i64 (rows of 8) or i32 (rows of 4) in the current module."""
    mod = e.b.module
    g = mod.globals.get(f"stream_run_{name}")
    if g is None:
        grid = _GRIDS[name]
        width = I64 if grid.shape[1] == 8 else I32
        words = grid.view(np.uint64 if grid.shape[1] == 8 else np.uint32).reshape(-1)
        ty = ir.ArrayType(width, len(words))
        g = ir.GlobalVariable(mod, ty, f"stream_run_{name}")
        g.global_constant, g.linkage = True, "internal"
        g.initializer = ir.Constant(ty, [ir.Constant(width, int(w)) for w in words])
    return g


def _row(e, name, idx):
    """Grid row idx (an integer value) as <8 x i8> or <4 x i8>."""
    bb = e.b
    word = bb.load(bb.gep(_table(e, name), [I32(0), bb.zext(idx, I64) if idx.type.width < 64 else idx]))
    return bb.bitcast(word, V(I8, _GRIDS[name].shape[1]))


def _concat(e, parts):
    """Concatenate equal-width vectors by repeated shuffles."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [e.shuffle(parts[i], parts[i + 1], list(range(2 * n))) for i in range(0, len(parts), 2)]
    return parts[0]


def _scaled(e, vals32, s_lo, s_hi=None):
    """<32 x i16>: vals * (2s + 1), s_lo for elements 0-15 and s_hi (default s_lo) for 16-31 (i32 scalars)."""
    bb = e.b

    def odd(s):
        return bb.trunc(bb.add(bb.shl(s, I32(1)), I32(1)), I16)

    lo = e.splat(odd(s_lo), 16)
    hi = lo if s_hi is None else e.splat(odd(s_hi), 16)
    return bb.mul(bb.sext(vals32, V(I16, 32)), e.shuffle(lo, hi, list(range(32))))


def _u(e, wb, blk, off, ty):
    return e.load(wb, e.off(blk, off), ty)


# ---- per format: yield (k, <32 x i16> (2s+1) * grid * sign for elements 32k .. 32k+31) ----
def _ctpop(e, v):
    """Per-lane population count (llvm.ctpop; vpopcntb with AVX512-BITALG)."""
    bb = e.b
    name = f"llvm.ctpop.v{v.type.count}i{v.type.element.width}"
    return bb.call(e.declare(name, v.type, [v.type]), [v])


def _ksign_masks(e, idx7):
    """<32 x i8> seven-bit sign indices of the 32 groups of 8 of a super-block (group 4k + m in lane 4k + m) ->
    <8 x i32> sign masks: byte m of word k is ggml's ksigns_iq2xs[index] (the 7 bits and their parity as bit 7),
    so bit 8m + j of word k is the sign of element 8m + j of sub-block k. All 32 groups at once, in vector lanes."""
    bb = e.b
    par = bb.shl(bb.and_(_ctpop(e, idx7), e.const(I8, 32, 1)), e.const(I8, 32, 7))
    return bb.bitcast(bb.or_(idx7, par), V(I32, 8))


def _sign_fields(e, words):
    """<8 x i32> words of 4 seven-bit sign indices each (bits 7m..7m+6) -> <32 x i8>, index m of word k in lane
    4k + m (IQ2_XXS's and IQ3_XXS's packing)."""
    bb = e.b
    packed = None
    for m in range(4):
        f = bb.and_(bb.lshr(words, e.const(I32, 8, 7 * m)), e.const(I32, 8, 127))
        f = bb.shl(f, e.const(I32, 8, 8 * m)) if m else f
        packed = f if packed is None else bb.or_(packed, f)
    return bb.bitcast(packed, V(I8, 32))


def _odd_scales(e, words):
    """2s + 1 of the 4-bit scales s in the top bits of <8 x i32> words."""
    bb = e.b
    return bb.add(bb.shl(bb.lshr(words, e.const(I32, 8, 28)), e.const(I32, 8, 1)), e.const(I32, 8, 1))


def _times(e, vals32, odd):
    """<32 x i16> vals32 (i8) times the i32 odd (one scale for the 32 elements)."""
    bb = e.b
    return bb.mul(bb.sext(vals32, V(I16, 32)), e.splat(bb.trunc(odd, I16), 32))


def _apply_mask(e, vals32, mask32):
    """vals32 <32 x i8> negated in the lanes whose bit is set in the i32 mask32 (a k-mask on AVX-512)."""
    bb = e.b
    return bb.select(bb.bitcast(mask32, V(ir.IntType(1), 32)), bb.sub(e.const(I8, 32, 0), vals32), vals32)


def _iq2_xxs(e, wb, blk):
    bb = e.b
    words = _u(e, wb, blk, 2, V(I32, 16))  # qs: per sub-block k, the index word 2k and the sign/scale word 2k+1
    aux1 = e.shuffle(words, words, list(range(1, 16, 2)))
    masks, odd = _ksign_masks(e, _sign_fields(e, aux1)), _odd_scales(e, aux1)
    for k in range(8):  # the grid rows one by one: a vector gather (vpgatherdq) measured slower on Zen 4
        aux0 = _u(e, wb, blk, 2 + 8 * k, I32)
        rows = [_row(e, "iq2xxs", bb.and_(bb.lshr(aux0, I32(8 * m)), I32(255))) for m in range(4)]
        vals = _apply_mask(e, _concat(e, rows), bb.extract_element(masks, I32(k)))
        yield k, _times(e, vals, bb.extract_element(odd, I32(k)))


def _iq2_xs(e, wb, blk):
    bb = e.b
    qs = _u(e, wb, blk, 2, V(I16, 32))
    masks = _ksign_masks(e, bb.trunc(bb.lshr(qs, e.const(I16, 32, 9)), V(I8, 32)))
    for k in range(8):
        idx = [bb.and_(bb.zext(bb.extract_element(qs, I32(4 * k + m)), I32), I32(511)) for m in range(4)]
        rows = [_row(e, "iq2xs", i) for i in idx]
        vals = _apply_mask(e, _concat(e, rows), bb.extract_element(masks, I32(k)))
        sc = bb.zext(_u(e, wb, blk, 66 + k, I8), I32)
        yield k, _scaled(e, vals, bb.and_(sc, I32(15)), bb.lshr(sc, I32(4)))


def _iq2_s(e, wb, blk):
    bb = e.b
    masks = _u(e, wb, blk, 34, V(I32, 8))  # the sign bytes, 4 per sub-block: each sub-block's 32-bit mask
    for k in range(8):
        qh = bb.zext(_u(e, wb, blk, 66 + k, I8), I32)
        rows = []
        for m in range(4):
            high = bb.shl(bb.and_(bb.lshr(qh, I32(2 * m)), I32(3)), I32(8))
            rows.append(_row(e, "iq2s", bb.or_(bb.zext(_u(e, wb, blk, 2 + 4 * k + m, I8), I32), high)))
        vals = _apply_mask(e, _concat(e, rows), bb.extract_element(masks, I32(k)))
        sc = bb.zext(_u(e, wb, blk, 74 + k, I8), I32)
        yield k, _scaled(e, vals, bb.and_(sc, I32(15)), bb.lshr(sc, I32(4)))


def _iq3_xxs(e, wb, blk):
    bb = e.b
    aux = _u(e, wb, blk, 66, V(I32, 8))  # scales_and_signs
    masks, odd = _ksign_masks(e, _sign_fields(e, aux)), _odd_scales(e, aux)
    for k in range(8):
        rows = [_row(e, "iq3xxs", _u(e, wb, blk, 2 + 8 * k + q, I8)) for q in range(8)]
        vals = _apply_mask(e, _concat(e, rows), bb.extract_element(masks, I32(k)))
        yield k, _times(e, vals, bb.extract_element(odd, I32(k)))


def _iq3_s(e, wb, blk):
    bb = e.b
    masks = _u(e, wb, blk, 74, V(I32, 8))  # the sign bytes, 4 per sub-block: each sub-block's 32-bit mask
    for k in range(8):
        qh = bb.zext(_u(e, wb, blk, 66 + k, I8), I32)
        rows = []
        for q in range(8):
            high = bb.shl(bb.and_(bb.lshr(qh, I32(q)), I32(1)), I32(8))
            idx = bb.or_(bb.zext(_u(e, wb, blk, 2 + 8 * k + q, I8), I32), high)
            rows.append(_row(e, "iq3s", idx))
        vals = _apply_mask(e, _concat(e, rows), bb.extract_element(masks, I32(k)))
        sc = bb.and_(bb.lshr(bb.zext(_u(e, wb, blk, 106 + k // 2, I8), I32), I32(4 * (k % 2))), I32(15))
        yield k, _scaled(e, vals, sc)


def _iq1_values(e, rows, signs8):
    """<32 x i8> 8 * grid + delta (delta +1, or -1 where signs8's lane is set), grid values -1, 0, 1."""
    bb = e.b
    v = bb.shl(_concat(e, rows), e.const(I8, 32, 3))
    return bb.add(v, bb.select(signs8, e.const(I8, 32, -1), e.const(I8, 32, 1)))


def _iq1_s(e, wb, blk):
    bb = e.b
    for k in range(8):
        qh = bb.zext(_u(e, wb, blk, 34 + 2 * k, I16), I32)
        rows = []
        for m in range(4):
            high = bb.shl(bb.and_(bb.lshr(qh, I32(3 * m)), I32(7)), I32(8))
            rows.append(_row(e, "iq1s", bb.or_(bb.zext(_u(e, wb, blk, 2 + 4 * k + m, I8), I32), high)))
        neg = bb.icmp_unsigned("!=", bb.and_(qh, I32(0x8000)), I32(0))
        vals = _iq1_values(e, rows, e.splat(neg, 32))
        yield k, _scaled(e, vals, bb.and_(bb.lshr(qh, I32(12)), I32(7)))


def _iq1_m(e, wb, blk):
    bb = e.b
    sc = [bb.zext(_u(e, wb, blk, 48 + 2 * j, I16), I32) for j in range(4)]
    for k in range(8):
        rows, negs = [], []
        for m in range(4):
            g = 4 * k + m
            nib = bb.and_(bb.lshr(bb.zext(_u(e, wb, blk, 32 + g // 2, I8), I32), I32(4 * (g % 2))), I32(15))
            idx = bb.or_(bb.zext(_u(e, wb, blk, g, I8), I32), bb.shl(bb.and_(nib, I32(7)), I32(8)))
            rows.append(_row(e, "iq1s", idx))
            negs.append(bb.icmp_unsigned("!=", bb.and_(nib, I32(8)), I32(0)))
        v = ir.Constant(V(ir.IntType(1), 4), ir.Undefined)
        for m, n in enumerate(negs):
            v = bb.insert_element(v, n, I32(m))
        vals = _iq1_values(e, rows, e.shuffle(v, v, [k2 // 8 for k2 in range(32)]))
        s_lo, s_hi = (bb.and_(bb.lshr(sc[j // 4], I32(3 * (j % 4))), I32(7)) for j in (2 * k, 2 * k + 1))
        yield k, _scaled(e, vals, s_lo, s_hi)


def _d_first(e, wb, blk):
    return e.f16x2(wb, blk)[0]


def _d_iq1_m(e, wb, blk):
    """IQ1_M's f16 scale, its four nibbles in the top nibbles of the four u16 scale words at 48."""
    bb = e.b
    sc = [_u(e, wb, blk, 48 + 2 * j, I16) for j in range(4)]
    top = ir.Constant(I16, 0xF000)
    bits = bb.or_(
        bb.or_(bb.lshr(bb.and_(sc[0], top), ir.Constant(I16, 12)), bb.lshr(bb.and_(sc[1], top), ir.Constant(I16, 8))),
        bb.or_(bb.lshr(bb.and_(sc[2], top), ir.Constant(I16, 4)), bb.and_(sc[3], top)),
    )
    return bb.fpext(bb.bitcast(bits, ir.HalfType()), F32)


def _dot(chunks, factor, d_of=_d_first):
    def body(e, wb, xqb, dxb, xsb, b, blk, accs):
        bb = e.b
        xb = bb.mul(b, ir.Constant(I64, 512))
        isum = ir.Constant(V(I32, 16), [0] * 16)
        for k, w in chunks(e, wb, blk):
            isum = bb.add(isum, e.pairdot(w, e.load(xqb, e.off(xb, 64 * k), V(I16, 32), 2)))
        d = bb.fmul(d_of(e, wb, blk), ir.Constant(F32, factor))
        s = bb.fmul(d, e.load(dxb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
        return [e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(s, 16))]

    return body


def _deq(chunks, factor, d_of=_d_first):
    def body(e, wb, blk, store):
        bb = e.b
        d = e.splat(bb.fmul(d_of(e, wb, blk), ir.Constant(F32, factor)), 32)
        for k, w in chunks(e, wb, blk):
            store(32 * k, bb.fmul(d, bb.sitofp(w, V(F32, 32))))

    return body


iq2_xxs_dot, iq2_xxs_deq = _row_intrinsic(66, _dot(_iq2_xxs, 0.125), 1), _deq_intrinsic(66, 256, _deq(_iq2_xxs, 0.125))
iq2_xs_dot, iq2_xs_deq = _row_intrinsic(74, _dot(_iq2_xs, 0.125), 1), _deq_intrinsic(74, 256, _deq(_iq2_xs, 0.125))
iq2_s_dot, iq2_s_deq = _row_intrinsic(82, _dot(_iq2_s, 0.125), 1), _deq_intrinsic(82, 256, _deq(_iq2_s, 0.125))
iq3_xxs_dot, iq3_xxs_deq = _row_intrinsic(98, _dot(_iq3_xxs, 0.25), 1), _deq_intrinsic(98, 256, _deq(_iq3_xxs, 0.25))
iq3_s_dot, iq3_s_deq = _row_intrinsic(110, _dot(_iq3_s, 1.0), 1), _deq_intrinsic(110, 256, _deq(_iq3_s, 1.0))
iq1_s_dot, iq1_s_deq = _row_intrinsic(50, _dot(_iq1_s, 0.125), 1), _deq_intrinsic(50, 256, _deq(_iq1_s, 0.125))
iq1_m_dot = _row_intrinsic(56, _dot(_iq1_m, 0.125, _d_iq1_m), 1)
iq1_m_deq = _deq_intrinsic(56, 256, _deq(_iq1_m, 0.125, _d_iq1_m))
