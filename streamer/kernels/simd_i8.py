"""Integer matrix-matrix products (prefill): weight tiles unpacked to bytes, activations as int8 digits.

The tile: ROWS = 32 weight rows unpacked once per matmul into unsigned codes u (0..255), 4-byte interleaved ([K/4][32
rows][4 bytes]), so that one 64-byte vector holds 4 consecutive elements of each of 16 rows and `vpdpbusd` (u8 x s8, 4
products summed into each int32 lane) gives 16 rows' partial dots against 4 bytes of one token broadcast to every lane.
The weight w = d_g * (u - OFF) - m_g per group g of G elements (G = 32, or 16 for Q6_K): the tile keeps d_g (and m_g,
the K-quant mins) per row as f32; OFF is the format's offset (Q8_0 128, Q4_0 8, Q6_K 32, Q4_K/Q5_K 0).

x ~= q * dx per group of G, q = rint(x / dx), dx = max|x| / XA_MAX (int8.quantize_act). q has two int8 digits, q = 256
hi + lo (XA_MAX = 32639): two vpdpbusd per 4 elements, combined exactly as 256 * the first + the second. One digit
(AVX2's default and STREAM_RUN_ACT=int8) is ggml's q8_0 activation, XA_MAX = 127: about twice as fast without vpdpbusd
but 257x coarser, past tests/test_model.py's bound against the float64 forward, so the tests check it against
llama.cpp's logits; its K-quant mins take the sums of the rounded x, as ggml's bsums. For each token and group the int32
sum  sum(u * q) - OFF * sum(q)  is exact, and one f32 step
    acc += float(isum) * (d_g * dx_g)   [ - m_g * xs_g, xs_g the f32 sum of x over the group ]
folds it in, so the error beyond f32 rounding is the activation step only. The bound per output (tests/test_int8.py,
tests/test_kernels.py check it against gguf-py in float64):
    |out - W.x| <= sum_k A_k (dx_g(k)/2 + 4u|x_k|) + gamma_n sum_k A_k |x_k|
with A_k = |w_k| plus the offset/min magnitudes, u = 2^-24, n = K + K/16 + 8 (as simd.py's matvec bound).

Three instruction sets, chosen in Python (int8.py), never inside a cached kernel: "vnni" calls
llvm.x86.avx512.vpdpbusd.512; "avx2" (4-bit codes only: Q4_0, Q4_K) vpmaddubsw with int16 partial sums
(_gemm_avx2_intrinsic); "generic" is plain vector IR that any LLVM target lowers. All form the same exact int32 sums
and the same f32 step (in their own order: they agree to about an ulp, tests/test_int8.py)."""

from llvmlite import ir
from numba import types

from ._bits import intrinsic
from .activations import XD1_MAX, XD_MAX
from .simd import F32, I8, I16, I32, I64, V, _c_array, _Emit, _k4_scales

ROWS = 32  # weight rows per tile: two 16-lane halves
HALF = 16


# ---- the 16x(G/4) int32 transpose: 16 rows' natural-order groups -> 4-byte interleave ----------------


def _transpose(e, vecs):
    """vecs: 16 vectors <n x i32> (row j's 4-byte chunks s = 0..n-1, n = 4 or 8) -> n vectors <16 x i32>
    (chunk s of rows 0..15), by 2-input shuffles (each lowers to one vpermt2d/vpunpck)."""
    n = vecs[0].type.count
    per = HALF // n  # rows per 16-lane register
    regs, labels = [], []
    for r in range(0, HALF, per):
        parts = [(vecs[r + q], [(r + q, s) for s in range(n)]) for q in range(per)]
        while len(parts) > 1:
            nxt = []
            for (a, la), (b, lb) in zip(parts[0::2], parts[1::2]):
                w = a.type.count
                nxt.append((e.shuffle(a, b, list(range(2 * w))), la + lb))
            parts = nxt
        v, lab = parts[0]
        regs.append(v)
        labels.append(lab)
    # Swap register-index bit p with lane bit p (a chunk bit) until register i holds chunk i.
    nreg = len(regs)
    p = 1
    while p < nreg:
        new_regs, new_labels = [None] * nreg, [None] * nreg
        for r0 in range(nreg):
            if r0 & p:
                continue
            r1 = r0 | p
            pool = {lab: (0, i) for i, lab in enumerate(labels[r0])}
            pool.update({lab: (1, i) for i, lab in enumerate(labels[r1])})
            for r in (r0, r1):
                want = []
                for lane in range(HALF):
                    src_r = (r & ~p) | (p if lane & p else 0)
                    src_lane = (lane & ~p) | (p if r & p else 0)
                    want.append(labels[src_r][src_lane])
                mask = [pool[lab][0] * HALF + pool[lab][1] for lab in want]
                new_regs[r] = e.shuffle(regs[r0], regs[r1], mask)
                new_labels[r] = want
        regs, labels = new_regs, new_labels
        p <<= 1
    out = []
    for s in range(n):  # find the register holding chunk s; order its lanes by row
        r = next(i for i, lab in enumerate(labels) if all(c == s for _, c in lab))
        pos = {lab: i for i, lab in enumerate(labels[r])}
        mask = [pos[(j, s)] for j in range(HALF)]
        out.append(regs[r] if mask == list(range(HALF)) else e.shuffle(regs[r], regs[r], mask))
    return out


# ---- per-format tile decoders -------------------------------------------------------------------------


def _decode_intrinsic(block_bytes, block_elems, group, scales_fn, values_fn):
    """Intrinsic `(w, r0, last, tile, sc, mn, nb)`: unpack rows r0..r0+31 of w (row index clamped to `last`)
    over nb blocks into tile (u8), and the f32 per-group scales / mins into sc / mn ([K/G][32])."""

    @intrinsic
    def dec(typingctx, w, r0, last, tile, sc, mn, nb):
        if not (
            isinstance(w, types.Array)
            and w.dtype == types.uint8
            and w.layout == "C"
            and w.ndim == 2
            and _c_array(tile, types.uint8)
            and _c_array(sc, types.float32)
            and _c_array(mn, types.float32)
        ):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            bb = builder
            w_, r0_, last_, tile_, sc_, mn_, nb_ = args
            wary = context.make_array(sig.args[0])(context, builder, w_)
            rowb = builder.extract_value(wary.strides, 0)
            wb = bb.bitcast(wary.data, ir.IntType(8).as_pointer())
            tb, scb, mnb = e.base(sig.args[3], tile_), e.base(sig.args[4], sc_), e.base(sig.args[5], mn_)

            def row_off(j):  # byte offset of row min(r0 + j, last)
                r = bb.add(r0_, j)
                return bb.mul(bb.select(bb.icmp_signed(">", r, last_), last_, r), rowb)

            gpb = block_elems // group  # groups per block

            def block(b, carried):
                boff = bb.mul(b, ir.Constant(I64, block_bytes))

                def srow(j, c):  # the f32 scales (and mins) of row j in this block -> sc/mn[(b*gpb + gl)*32 + j]
                    dsc, dmn = scales_fn(e, wb, bb.add(row_off(j), boff))
                    for gl in range(gpb):
                        g = bb.add(bb.mul(b, ir.Constant(I64, gpb)), ir.Constant(I64, gl))
                        at = bb.mul(bb.add(bb.mul(g, ir.Constant(I64, ROWS)), j), ir.Constant(I64, 4))
                        bb.store(dsc[gl], e.ptr(scb, at, F32), align=4)
                        if dmn is not None:
                            bb.store(dmn[gl], e.ptr(mnb, at, F32), align=4)
                    return c

                e.loop(ir.Constant(I64, ROWS), [], srow)

                def half(h, hc):  # rows 16h .. 16h + 15 (loops, not unrolled: less code to compile)
                    hrow = bb.mul(h, ir.Constant(I64, HALF))

                    def part(p, pc):  # values_fn.n_parts code vectors per row, groups p * len + i
                        vals = [
                            values_fn(e, wb, bb.add(row_off(bb.add(hrow, ir.Constant(I64, j))), boff), p)
                            for j in range(HALF)
                        ]
                        for gi in range(len(vals[0])):
                            vs = [bb.bitcast(v[gi], V(I32, group // 4)) for v in vals]
                            chunks = _transpose(e, vs)
                            gl = bb.add(bb.mul(p, ir.Constant(I64, len(vals[0]))), ir.Constant(I64, gi))
                            # element index of this group's first element, in the row
                            g0 = bb.add(bb.mul(b, ir.Constant(I64, block_elems)), bb.mul(gl, ir.Constant(I64, group)))
                            for s, cv in enumerate(chunks):
                                c = bb.add(bb.udiv(g0, ir.Constant(I64, 4)), ir.Constant(I64, s))
                                off = bb.add(bb.mul(c, ir.Constant(I64, 4 * ROWS)), bb.mul(h, ir.Constant(I64, 64)))
                                bb.store(cv, e.ptr(tb, off, V(I32, 16)), align=1)
                        return pc

                    e.loop(ir.Constant(I64, values_fn.n_parts), [], part)
                    return hc

                e.loop(ir.Constant(I64, 2), [], half)
                return carried

            e.loop(nb_, [], block)
            return context.get_dummy_value()

        return types.none(w, types.int64, types.int64, tile, sc, mn, types.int64), codegen

    return dec


class _Values:
    """values(e, wb, at, part) -> list of n <G x i8> code vectors, groups part * n .. of the block; part is a
    runtime i64 in range(n_parts)."""

    def __init__(self, fn, n_parts):
        self.fn, self.n_parts = fn, n_parts

    def __call__(self, e, wb, at, part):
        return self.fn(e, wb, at, part)


def _q8_0_scales(e, wb, at):
    return [e.f16x2(wb, at)[0]], None


def _q8_0_values(e, wb, at, part):
    q = e.load(wb, e.off(at, 2), V(I8, 32))
    return [e.b.xor(q, e.const(I8, 32, -128))]  # q + 128 as an unsigned byte


def _q4_0_values(e, wb, at, part):
    bb = e.b
    q = e.load(wb, e.off(at, 2), V(I8, 16))
    return [e.shuffle(bb.and_(q, e.const(I8, 16, 15)), bb.lshr(q, e.const(I8, 16, 4)), list(range(32)))]


def _k4_scale_fn(e, wb, at):
    bb = e.b
    d, dmin = e.f16x2(wb, at)
    scales, mins = _k4_scales(e, wb, e.off(at, 4))
    dsc = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
    dmn = bb.fmul(e.splat(dmin, 8), bb.uitofp(mins, V(F32, 8)))
    return [bb.extract_element(dsc, I32(j)) for j in range(8)], [bb.extract_element(dmn, I32(j)) for j in range(8)]


def _bshift(e, n):  # a runtime i64 shift count as <32 x i8>
    return e.splat(e.b.trunc(n, I8), 32)


def _q45_k_values(qs_at, has_qh):
    def fn(e, wb, at, c):  # c: 32-byte chunk of qs -> groups 2c (low nibbles), 2c + 1 (high)
        bb = e.b
        q = e.load(wb, bb.add(at, bb.add(bb.mul(c, ir.Constant(I64, 32)), ir.Constant(I64, qs_at))), V(I8, 32))
        lo, hi = bb.and_(q, e.const(I8, 32, 15)), bb.lshr(q, e.const(I8, 32, 4))
        if has_qh:
            qh = e.load(wb, e.off(at, 16), V(I8, 32))
            one, four = e.const(I8, 32, 1), e.const(I8, 32, 4)
            c2 = bb.mul(c, ir.Constant(I64, 2))
            lo = bb.or_(lo, bb.shl(bb.and_(bb.lshr(qh, _bshift(e, c2)), one), four))
            hi = bb.or_(hi, bb.shl(bb.and_(bb.lshr(qh, _bshift(e, bb.add(c2, ir.Constant(I64, 1)))), one), four))
        return [lo, hi]

    return fn


def _q6_k_scale_fn(e, wb, at):
    bb = e.b
    d = e.f16x2(wb, e.off(at, 206))[1]
    dsc = bb.fmul(e.splat(d, 16), bb.sitofp(e.load(wb, e.off(at, 192), V(I8, 16)), V(F32, 16)))
    return [bb.extract_element(dsc, I32(j)) for j in range(16)], None


def _q6_k_values(e, wb, at, part):
    """part = (h, k): the 32 elements 128h + 32k.., as two groups of 16 (raw 6-bit codes 0..63)."""
    bb = e.b
    c = lambda k: ir.Constant(I64, k)  # noqa: E731
    h, k = bb.lshr(part, c(2)), bb.and_(part, c(3))
    ql = e.load(wb, bb.add(at, bb.add(bb.mul(h, c(64)), bb.mul(bb.and_(k, c(1)), c(32)))), V(I8, 32))
    qh = e.load(wb, bb.add(at, bb.add(c(128), bb.mul(h, c(32)))), V(I8, 32))
    nib = bb.and_(bb.lshr(ql, _bshift(e, bb.mul(bb.lshr(k, c(1)), c(4)))), e.const(I8, 32, 15))
    top = bb.shl(bb.and_(bb.lshr(qh, _bshift(e, bb.mul(k, c(2)))), e.const(I8, 32, 3)), e.const(I8, 32, 4))
    q = bb.or_(nib, top)
    return [e.shuffle(q, q, list(range(16))), e.shuffle(q, q, list(range(16, 32)))]


q8_0_tile = _decode_intrinsic(34, 32, 32, _q8_0_scales, _Values(_q8_0_values, 1))
q4_0_tile = _decode_intrinsic(18, 32, 32, _q8_0_scales, _Values(_q4_0_values, 1))
q4_k_tile = _decode_intrinsic(144, 256, 32, _k4_scale_fn, _Values(_q45_k_values(16, False), 4))
q5_k_tile = _decode_intrinsic(176, 256, 32, _k4_scale_fn, _Values(_q45_k_values(48, True), 4))
q6_k_tile = _decode_intrinsic(210, 256, 16, _q6_k_scale_fn, _Values(_q6_k_values, 8))


# ---- the tile product -----------------------------------------------------------------------------------


def _dp_vnni(e, acc, w, x):
    v16 = V(I32, 16)
    fn = e.declare("llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
    return e.b.call(fn, [acc, e.b.bitcast(w, v16), e.b.bitcast(x, v16)])


def _dp_generic(e, acc, w, x):
    """acc + (sums of 4 adjacent u8(w) * s8(x) products): exact i16 products summed in pairs (vpmaddwd),
    then pairs of pairs."""
    bb = e.b
    w16, x16 = bb.zext(w, V(I16, 64)), bb.sext(x, V(I16, 64))
    lo = e.pairdot(e.shuffle(w16, w16, list(range(32))), e.shuffle(x16, x16, list(range(32))))
    hi = e.pairdot(e.shuffle(w16, w16, list(range(32, 64))), e.shuffle(x16, x16, list(range(32, 64))))
    both = e.shuffle(lo, hi, list(range(32)))
    u = ir.Constant(V(I32, 32), ir.Undefined)
    return bb.add(acc, bb.add(e.shuffle(both, u, list(range(0, 32, 2))), e.shuffle(both, u, list(range(1, 32, 2)))))


def _gemm_args_ok(tile, sc, mn, xq, dx, xs, xc, dst) -> bool:
    """The tile products' argument types: C-contiguous arrays of these dtypes, xq two-dimensional."""
    return (
        _c_array(tile, types.uint8)
        and _c_array(sc, types.float32)
        and _c_array(mn, types.float32)
        and _c_array(xq, types.int8)
        and _c_array(dx, types.float32)
        and _c_array(xs, types.float32)
        and _c_array(xc, types.int32)
        and _c_array(dst, types.float32)
        and xq.ndim == 2
    )


def _gemm_bases(e, sig, args):
    """A tile product's (tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld) as byte pointers, with xq's bytes per
    token row: (tile, sc, mn, xq, xq row bytes, dx, xs, xc, dst)."""
    xqa = e.c.make_array(sig.args[3])(e.c, e.b, args[3])
    xrb = e.b.extract_value(xqa.shape, 1)
    xqb = e.b.bitcast(xqa.data, I8.as_pointer())
    tb, scb, mnb = (e.base(sig.args[i], args[i]) for i in range(3))
    dxb, xsb, xcb = (e.base(sig.args[i], args[i]) for i in range(4, 7))
    return tb, scb, mnb, xqb, xrb, dxb, xsb, xcb, e.base(sig.args[8], args[8])


def _gemm_intrinsic(n_tok, group, has_min, dp, digits):
    """Intrinsic `(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)`: for tokens t0..t0+n_tok-1 and the 32
    rows of the tile, dst[doff + t*ld + j] = row j . x_t (f32; ld = dst's row stride in elements).
    digits = 2: x is int16 held as two int8 digits, xq = 256 * hi + lo, stored per 4 elements as 4 hi bytes
    then 4 lo bytes (xq is [m, 2K]); two vpdpbusd per 4 elements, combined exactly in int32."""

    @intrinsic
    def gemm(typingctx, tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld):
        if not _gemm_args_ok(tile, sc, mn, xq, dx, xs, xc, dst):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            bb = builder
            t0_, doff_, ld_ = args[7], args[9], args[10]
            tb, scb, mnb, xqb, xrb, dxb, xsb, xcb, db = _gemm_bases(e, sig, args)
            K = bb.udiv(xrb, ir.Constant(I64, digits))
            ng = bb.udiv(K, ir.Constant(I64, group))
            xrow = [bb.mul(bb.add(t0_, ir.Constant(I64, t)), xrb) for t in range(n_tok)]  # byte offsets of x_t
            grow = [bb.mul(bb.add(t0_, ir.Constant(I64, t)), ng) for t in range(n_tok)]  # group-array rows
            zero = ir.Constant(V(F32, 16), [0.0] * 16)
            steps = group // 4

            def body(g, accs):
                k0 = bb.mul(g, ir.Constant(I64, group))
                iacc = []
                for t in range(n_tok):
                    c = e.load(xcb, bb.mul(bb.add(grow[t], g), ir.Constant(I64, 4)), I32, 4)
                    iacc.append([e.splat(c, 16), e.splat(c, 16)])
                izero = ir.Constant(V(I32, 16), [0] * 16)
                ihi = [[izero, izero] for t in range(n_tok)]
                for s in range(steps):
                    chunk = bb.add(bb.udiv(k0, ir.Constant(I64, 4)), ir.Constant(I64, s))
                    toff = bb.mul(chunk, ir.Constant(I64, 4 * ROWS))
                    wv = [e.load(tb, bb.add(toff, ir.Constant(I64, 64 * h)), V(I8, 64), 1) for h in range(2)]
                    xc0 = bb.mul(chunk, ir.Constant(I64, 4 * digits))
                    for t in range(n_tok):
                        for d, acc in ((digits - 1, iacc), (0, ihi))[:digits]:
                            xi = e.load(xqb, bb.add(xrow[t], bb.add(xc0, ir.Constant(I64, 4 * d))), I32, 4)
                            xv = bb.bitcast(e.splat(xi, 16), V(I8, 64))
                            for h in range(2):
                                acc[t][h] = dp(e, acc[t][h], wv[h], xv)
                if digits == 2:
                    eight = ir.Constant(V(I32, 16), [8] * 16)
                    iacc = [[bb.add(bb.shl(ihi[t][h], eight), iacc[t][h]) for h in range(2)] for t in range(n_tok)]
                new = list(accs)
                goff = bb.mul(g, ir.Constant(I64, 4 * ROWS))
                scv = [e.load(scb, bb.add(goff, ir.Constant(I64, 64 * h)), V(F32, 16), 4) for h in range(2)]
                mnv = (
                    [e.load(mnb, bb.add(goff, ir.Constant(I64, 64 * h)), V(F32, 16), 4) for h in range(2)]
                    if has_min
                    else None
                )
                for t in range(n_tok):
                    gi = bb.mul(bb.add(grow[t], g), ir.Constant(I64, 4))
                    dxs = e.splat(e.load(dxb, gi, F32, 4), 16)
                    xss = e.splat(e.load(xsb, gi, F32, 4), 16) if has_min else None
                    for h in range(2):
                        a = new[2 * t + h]
                        f = bb.sitofp(iacc[t][h], V(F32, 16))
                        a = e.fma(a, f, bb.fmul(scv[h], dxs, flags=("fast",)))
                        if has_min:
                            a = bb.fsub(a, bb.fmul(mnv[h], xss, flags=("fast",)), flags=("fast",))
                        new[2 * t + h] = a
                return new

            accs = e.loop(ng, [zero] * (2 * n_tok), body)
            for t in range(n_tok):
                row = bb.add(doff_, bb.mul(ir.Constant(I64, t), ld_))
                for h in range(2):
                    at = bb.mul(bb.add(row, ir.Constant(I64, 16 * h)), ir.Constant(I64, 4))
                    bb.store(accs[2 * t + h], e.ptr(db, at, V(F32, 16)), align=4)
            return context.get_dummy_value()

        sig = types.none(tile, sc, mn, xq, dx, xs, xc, types.int64, dst, types.int64, types.int64)
        return sig, codegen

    return gemm


def _gemm_avx2_intrinsic(has_min, digits):
    """The tile product of _gemm_intrinsic (same arguments, same N_TOK tokens x 32 rows out) for AVX2 without VNNI,
    for 4-bit codes (u <= 15: Q4_0, Q4_K) and groups of 32. Per pass, 2 tokens x 16 rows (two ymm of 8 rows x 4
    bytes): per 4 elements one vpmaddubsw per ymm and digit (pair sums <= 3840), added in int16 over the group's 8
    steps (<= 30720: exact), then one vpmaddwd by 1 per digit into int32: the same isum and f32 step as
    _gemm_intrinsic. 2 tokens per pass, not one (2026-12-07: 1.0-1.4x the f32 tiles, one token only matched them)."""
    steps, tp = 8, 2

    @intrinsic
    def gemm(typingctx, tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld):
        if not _gemm_args_ok(tile, sc, mn, xq, dx, xs, xc, dst):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            bb = builder
            c = lambda k: ir.Constant(I64, k)  # noqa: E731
            t0_, doff_, ld_ = args[7], args[9], args[10]
            tb, scb, mnb, xqb, xrb, dxb, xsb, xcb, db = _gemm_bases(e, sig, args)
            ng = bb.udiv(bb.udiv(xrb, c(digits)), c(32))
            mub = e.declare("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [V(I8, 32), V(I8, 32)])
            mwd = e.declare("llvm.x86.avx2.pmadd.wd", V(I32, 8), [V(I16, 16), V(I16, 16)])
            ones, eight = ir.Constant(V(I16, 16), [1] * 16), ir.Constant(V(I32, 8), [8] * 8)
            z16, zf = ir.Constant(V(I16, 16), [0] * 16), ir.Constant(V(F32, 8), [0.0] * 8)

            def one_pass(p, carried):  # tokens 2 (p // 2) and 2 (p // 2) + 1, rows 16 (p % 2) ..
                pair, h = bb.udiv(p, c(2)), bb.urem(p, c(2))
                toks = [bb.add(bb.mul(pair, c(tp)), c(u)) for u in range(tp)]
                xrow = [bb.mul(bb.add(t0_, t), xrb) for t in toks]
                grow = [bb.mul(bb.add(t0_, t), ng) for t in toks]
                hoff = bb.mul(h, c(64))

                def group(g, accs):
                    sums = [[[z16, z16] for _ in range(digits)] for _ in range(tp)]
                    for s in range(steps):
                        chunk = bb.add(bb.mul(g, c(steps)), c(s))
                        toff = bb.add(bb.mul(chunk, c(4 * ROWS)), hoff)
                        ws = [e.load(tb, bb.add(toff, c(32 * i)), V(I8, 32), 1) for i in range(2)]
                        for u in range(tp):
                            x0 = bb.add(xrow[u], bb.mul(chunk, c(4 * digits)))
                            for d in range(digits):  # d = 0: the hi digit (two digits) or the one digit
                                xi = e.load(xqb, bb.add(x0, c(4 * d)), I32, 4)
                                xv = bb.bitcast(e.splat(xi, 8), V(I8, 32))
                                for i in range(2):
                                    sums[u][d][i] = bb.add(sums[u][d][i], bb.call(mub, [ws[i], xv]))
                    goff = bb.add(bb.mul(g, c(4 * ROWS)), hoff)
                    scv = [e.load(scb, bb.add(goff, c(32 * i)), V(F32, 8), 4) for i in range(2)]
                    mnv = [e.load(mnb, bb.add(goff, c(32 * i)), V(F32, 8), 4) for i in range(2)] if has_min else None
                    new = []
                    for u in range(tp):
                        gi = bb.mul(bb.add(grow[u], g), c(4))
                        corr = e.splat(e.load(xcb, gi, I32, 4), 8)
                        dxs = e.splat(e.load(dxb, gi, F32, 4), 8)
                        xss = e.splat(e.load(xsb, gi, F32, 4), 8) if has_min else None
                        for i in range(2):
                            w32 = [bb.call(mwd, [sums[u][d][i], ones]) for d in range(digits)]
                            isum = w32[0] if digits == 1 else bb.add(bb.shl(w32[0], eight), w32[1])
                            f = bb.sitofp(bb.add(isum, corr), V(F32, 8))
                            a = e.fma(accs[2 * u + i], f, bb.fmul(scv[i], dxs, flags=("fast",)))
                            if has_min:
                                a = bb.fsub(a, bb.fmul(mnv[i], xss, flags=("fast",)), flags=("fast",))
                            new.append(a)
                    return new

                accs = e.loop(ng, [zf] * (2 * tp), group)
                for u in range(tp):
                    row = bb.add(doff_, bb.mul(toks[u], ld_))
                    for i in range(2):
                        at = bb.mul(bb.add(row, bb.add(bb.mul(h, c(16)), c(8 * i))), c(4))
                        bb.store(accs[2 * u + i], e.ptr(db, at, V(F32, 8)), align=4)
                return carried

            e.loop(c(2 * (N_TOK // tp)), [], one_pass)
            return context.get_dummy_value()

        sig = types.none(tile, sc, mn, xq, dx, xs, xc, types.int64, dst, types.int64, types.int64)
        return sig, codegen

    return gemm


N_TOK = 4  # tokens per register block: 2 x 4 int32 + 2 x 4 f32 accumulators + 2 weight vectors

# gemm_<isa>_<digits>_<group>_<mins>: the variants int8.py's kernels pick from (module globals for numba).
for _isa, _dp in (("vnni", _dp_vnni), ("generic", _dp_generic)):
    for _d in (1, 2):
        for _g, _m in ((32, 0), (32, 1), (16, 0)):
            globals()[f"gemm_{_isa}_{_d}_{_g}_{_m}"] = _gemm_intrinsic(N_TOK, _g, _m, _dp, _d)
for _d in (1, 2):  # AVX2 without VNNI: Q4_0 and Q4_K only (codes <= 15, groups of 32)
    for _m in (0, 1):
        globals()[f"gemm_avx2_{_d}_32_{_m}"] = _gemm_avx2_intrinsic(_m, _d)


# ---- activation digits: one 32-element group per call, vectorized (simd_vnni's quantizers use them too) --


def _vcall(e, name, v):
    """A one-argument LLVM vector intrinsic (llvm.fabs / llvm.rint) on v."""
    return e.b.call(e.declare(f"{name}.v{v.type.count}f32", v.type, [v.type]), [v])


def int_sum(e, v):
    """The sum of an integer vector's lanes (a tree: exact while it fits)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = e.b.add(e.shuffle(v, v, list(range(n))), e.shuffle(v, v, list(range(n, 2 * n))))
    return e.b.extract_element(v, I32(0))


def abs_max(e, a):
    """The largest lane of a (|x| values): exact, a tree of maxima."""
    bb = e.b
    n = a.type.count
    while n > 1:
        n //= 2
        lo_, hi_ = e.shuffle(a, a, list(range(n))), e.shuffle(a, a, list(range(n, 2 * n)))
        a = bb.select(bb.fcmp_ordered(">", hi_, lo_), hi_, lo_)
    return bb.extract_element(a, I32(0))


def group_digits(e, xb, dxb, xsb, g, levels, amax=None):
    """The 32 f32 of group g at xb -> dx[g] = max|x| / levels, xs[g], and (q, hi, lo): q = rint(x / dx[g]) as <32 x
    i32> (0 if the group is all zero), q = 256 hi + lo with lo in [-128, 127]. xs[g] is the sum of x (f32, a tree
    sum) with two digits' levels, and with one digit's (XD1_MAX) float(sum q) * dx[g], as ggml's bsums: the K-quant
    mins then see the x the dots see (the exact sum doubled the tiny Q4_K models' error, 2026-12-02). amax: the
    scale's max|x| if the caller took it over more than the group (digits256: one per super-block). Shared by
    digits32 and digits256 (simd_vnni) and digits_i8 (here), which store the digits in their layouts."""
    bb = e.b
    c = lambda k: ir.Constant(I64, k)  # noqa: E731
    v = e.load(xb, bb.mul(g, c(128)), V(F32, 32), 4)
    if amax is None:
        amax = abs_max(e, _vcall(e, "llvm.fabs", v))
    lv = ir.Constant(F32, float(levels))
    gi = bb.mul(g, c(4))
    dx = bb.fdiv(amax, lv)
    bb.store(dx, e.ptr(dxb, gi, F32), align=4)
    inv = bb.select(bb.fcmp_ordered(">", amax, ir.Constant(F32, 0.0)), bb.fdiv(lv, amax), ir.Constant(F32, 0.0))
    q = bb.fptosi(_vcall(e, "llvm.rint", bb.fmul(v, e.splat(inv, 32))), V(I32, 32))
    if levels == XD1_MAX:  # one digit: the sum of the rounded x (an exact int32 sum, one f32 rounding)
        bb.store(bb.fmul(bb.sitofp(int_sum(e, q), F32), dx), e.ptr(xsb, gi, F32), align=4)
    else:
        bb.store(e.hsum(v), e.ptr(xsb, gi, F32), align=4)
    k128, k255, k8 = (e.const(I32, 32, k) for k in (128, 255, 8))
    lo = bb.sub(bb.and_(bb.add(q, k128), k255), k128)
    return q, bb.ashr(bb.sub(q, lo), k8), lo


@intrinsic
def digits_i8(typingctx, x, xq, dx, xs, xc, g, off):
    """Group g (elements 32g..32g+31) of x -> dx[g] = max|x| / XA_MAX, xs[g] = sum of x (f32, a tree sum),
    q = rint(x / dx[g]) (0 if the group is all zero) as two int8 digits q = 256 hi + lo stored per 4 elements as
    their 4 hi bytes, then their 4 lo bytes (xq[64g:64g+64]), and xc[g] = -off * sum(q): int8.quantize_act's
    two-digit layout, 32-element groups (XA_MAX = 127 * 256 + 127)."""
    if not (
        _c_array(x, types.float32)
        and _c_array(xq, types.int8)
        and _c_array(dx, types.float32)
        and _c_array(xs, types.float32)
        and _c_array(xc, types.int32)
    ):
        return None

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        bb = builder
        x_, xq_, dx_, xs_, xc_, g_, off_ = args
        xb, xqb, dxb, xsb, xcb = (e.base(sig.args[i], a) for i, a in enumerate((x_, xq_, dx_, xs_, xc_)))
        c = lambda k: ir.Constant(I64, k)  # noqa: E731
        q, hi, lo = group_digits(e, xb, dxb, xsb, g_, XD_MAX)
        gi = bb.mul(g_, c(4))
        mask = [(4 * (p // 8) + p % 8) if p % 8 < 4 else (32 + 4 * (p // 8) + p % 8 - 4) for p in range(64)]
        both = e.shuffle(bb.trunc(hi, V(I8, 32)), bb.trunc(lo, V(I8, 32)), mask)
        bb.store(both, e.ptr(xqb, bb.mul(g_, c(64)), V(I8, 64)), align=1)
        qsum = int_sum(e, q)
        bb.store(bb.mul(bb.neg(bb.trunc(off_, I32)), qsum), e.ptr(xcb, gi, I32), align=4)
        return context.get_dummy_value()

    return types.none(x, xq, dx, xs, xc, types.int64, types.int64), codegen
