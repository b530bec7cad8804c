"""The MoE prefill's few-token Q4_K product: each weight row read once, dotted with up to 16 tokens in lanes.

At 128 prefill tokens an expert gets about 8 of them: simd_i8.py's tile kernel then spends more time unpacking each
weight tile than multiplying it, and the decode row dot (simd_vnni.py) redoes the nibble and scale work per token. Here
the weights stay in their Q4_K rows, read front to back, and the activations are rearranged instead (once per expert, by
lanes.pack).

Lanes: T tokens (T = 2, 4, 8, 16: the expert's count rounded up), Tv = min(T, 8) per vector, Cp = 8 / Tv. A 32-byte run
q of qs holds elements 0..31 of sub-blocks 2q (low nibbles) and 2q + 1 (high nibbles). Lane L = 2 Cp t + Cp k + c' of a
vector holds token t's chunk (4 elements) Cp s + c' of sub-block 2q + k: 4 Cp bytes of the run (chunk group s) broadcast
to every lane group and masked with 0x0F (k = 0) or 0xF0 (k = 1) are the weight codes u (and 16 u) of both sub-blocks
for all Tv tokens, so one load, one shuffle and ONE mask feed a vpdpbusd per activation digit and vector; each lane
sums a whole sub-block's chunks for its token over s < Tv, as 256 * sum(u * hi) + sum(u * lo) (two digits) or sum(u * q)
(one) in int32 (exact; the high nibbles' factor 16 is undone by the exact scale d * sc / 16), then per lane in f32
    acc += float(isum) * (d * sc_(2q+k) * dx_t,(2q+k)),   accm += dmin * m_(2q+k) * xs_t,(2q+k)  (xs in c' = 0)
and at the row's end each token's 2 Cp lanes are added up (a shuffle tree). R rows per call share each activation vector
load; 4 Q4_K rows stream in ahead (software prefetch).

Accuracy: the activations are int8.quantize_act's digits, two by default and one where int8.DIGITS is 1 (AVX2), the
integer sums and float(isum) exact, so the bound is simd_i8.py's tile kernel's on the same grid; only the f32
summation order differs:
    |out - W.x| <= sum_k A_k (dx_g(k)/2 + 4u|x_k|) + gamma_n sum_k A_k |x_k|,   u = 2^-24,
with A_k = |w_k| plus the min term's magnitude and n = K + K/16 + 8 (tests/test_lanes.py); with one digit the mins
take the sums of the rounded x (ggml's bsums), so the result is W . (q dx) to f32 rounding. A token's result depends on
its own lanes and on T only; the caller picks T from the expert's token count alone (and the token's rank in it, where
lanes.split_lanes makes two passes), so it is the same for every cache state.

Instruction sets as simd_i8.py: "vnni" (vpdpbusd) or "generic" (plain vector IR), chosen in Python (lanes.py), and
"avx2" for CPUs without VNNI (lanes.host_isa): vpmaddubsw's pair sums would saturate on 16 u, so the high nibbles are
shifted down to u (scale d * sc: the same products), and the pair sums of all Tv chunk vectors are added in int16
before one vpmaddwd per digit (simd_vnni._dp2_avx2): the same bits as "generic". One digit halves those integer
instructions and the activation bytes (2026-12-07, AMD EPYC Zen 4 with AVX2-only kernels: the lanes' share of a
32-token 30B-A3B prefill 0.37 -> 0.27 s). At most 8 tokens (lanes.SPLIT_AVX2)
and one row per call (ROWS_AVX2): AVX2 has 16 vector registers."""

from llvmlite import ir
from numba import types

from ._bits import intrinsic
from .simd import F32, I8, I32, I64, V, _c_array, _Emit, _k4_scales
from .simd_i8 import _dp_generic, _dp_vnni
from .simd_vnni import _digits_dot, _dp_avx2

BLOCK = 144  # bytes of a Q4_K super-block
# weight rows per call, by T: they share each activation vector load; more rows at T = 8, 16 spill registers
ROWS = {16: 2, 8: 2, 4: 4, 2: 4}
# on AVX2 (16 vector registers) one row per call is fastest at every T, and T = 16 is slower per token than
# T = 8 (lanes.SPLIT_AVX2: two passes)
ROWS_AVX2 = {8: 1, 4: 1, 2: 1}


def _row_intrinsic(T, isa, R, digits=2):
    """Intrinsic `(w, off, row_bytes, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)`: the R Q4_K rows at byte
    off + i * row_bytes of w (i < R; rows past nr repeat row nr - 1 and are not stored; nb super-blocks each)
    dotted with the T tokens packed at byte xo of xt (lanes.pack's layout, `digits` activation digits) with their
    dx / xs lanes from f32 index lo of dl / sl: dst[doff + t * ld + i] = row i's dot for token t < n. The R rows
    share each activation vector load."""
    Tv = min(T, 8)  # tokens per vector
    NV = T // Tv  # vectors per (chunk run, digit)
    Cp = 8 // Tv  # chunks per lane group
    high = [(L // Cp) % 2 for L in range(16)]  # lanes of the odd sub-block: the high nibbles
    # vpdpbusd takes the high nibbles masked in place, as 16 u; vpmaddubsw would saturate on those (pair sums
    # up to 2 * 240 * 128), so AVX2 shifts them down first (u)
    shift = isa == "avx2"
    bmask = [15 if shift or h == 0 else -16 for h in high for _ in range(4)]
    dp = {"vnni": _dp_vnni, "generic": _dp_generic, "avx2": _dp_avx2}[isa]

    @intrinsic
    def row(typingctx, w, off, row_bytes, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n):
        if not (
            _c_array(w, types.uint8)
            and _c_array(xt, types.int8)
            and _c_array(dl, types.float32)
            and _c_array(sl, types.float32)
            and _c_array(dst, types.float32)
        ):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            bb = builder
            w_, off_, rb_, nr_, nb_, xt_, xo_, dl_, sl_, lo_, dst_, doff_, ld_, n_ = args
            wb, xb = e.base(sig.args[0], w_), e.base(sig.args[5], xt_)
            dlb, slb, db = e.base(sig.args[7], dl_), e.base(sig.args[8], sl_), e.base(sig.args[10], dst_)
            c = lambda k: ir.Constant(I64, k)  # noqa: E731
            zero_f = ir.Constant(V(F32, 16), [0.0] * 16)
            mask = ir.Constant(V(I8, 64), bmask)
            by = ir.Constant(V(I32, 16), [4 * h for h in high])
            lo_b = bb.mul(lo_, c(4))
            last = bb.sub(nr_, c(1))
            roff = []
            for i in range(R):
                ri = c(i)
                ri = bb.select(bb.icmp_signed(">", ri, last), last, ri)
                roff.append(bb.add(off_, bb.mul(ri, rb_)))

            def step(b, accs):
                bo = bb.mul(b, c(BLOCK))
                blks = [bb.add(ro, bo) for ro in roff]
                # the next R rows (contiguous after these), R super-blocks' bytes per step: read by the time
                # these rows are done
                ahead = bb.add(bb.add(off_, bb.mul(rb_, c(R))), bb.mul(b, c(R * BLOCK)))
                for k in range(0, R * BLOCK, 64):
                    e.prefetch(wb, e.off(ahead, k))
                dsc, dmn = [], []
                for blk in blks:
                    d, dmin = e.f16x2(wb, blk)
                    scales, mins = _k4_scales(e, wb, e.off(blk, 4))
                    ds = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
                    # the high nibbles are taken as 16 u: their scale / 16 (exact)
                    dsc.append(ds if shift else bb.fmul(ds, ir.Constant(V(F32, 8), [1.0, 0.0625] * 4)))
                    dmn.append(bb.fmul(e.splat(dmin, 8), bb.uitofp(mins, V(F32, 8))))
                acc = list(accs)  # [row][v]: acc, then [row][v]: accm
                for cc in range(4):
                    run = bb.add(bb.mul(b, c(4)), c(cc))  # chunk run (sub-blocks 2cc, 2cc + 1) in the row
                    xr = bb.add(xo_, bb.mul(run, c(64 * digits * T)))
                    # [digit][s][v]: the hi digits (or the one digit), then the lo digits
                    xd = [
                        [
                            [
                                e.load(xb, bb.add(xr, c(64 * (digits * (s * NV + v) + d))), V(I8, 64), 1)
                                for v in range(NV)
                            ]
                            for s in range(Tv)
                        ]
                        for d in range(digits)
                    ]
                    lat = [bb.add(lo_b, bb.mul(bb.add(bb.mul(run, c(NV)), c(v)), c(64))) for v in range(NV)]
                    dxv = [e.load(dlb, la, V(F32, 16), 4) for la in lat]
                    xsv = [e.load(slb, la, V(F32, 16), 4) for la in lat]
                    pick = [2 * cc + (L // Cp) % 2 for L in range(16)]
                    for i, blk in enumerate(blks):
                        ws = []
                        for s in range(Tv):
                            raw = e.load(wb, e.off(blk, 16 + 32 * cc + 4 * Cp * s), V(I32, Cp) if Cp > 1 else I32)
                            v16 = e.shuffle(raw, raw, [L % Cp for L in range(16)]) if Cp > 1 else e.splat(raw, 16)
                            if shift:
                                v16 = bb.lshr(v16, by)
                            ws.append(bb.and_(bb.bitcast(v16, V(I8, 64)), mask))
                        scl = e.shuffle(dsc[i], dsc[i], pick)
                        mnv = e.shuffle(dmn[i], dmn[i], pick)
                        for v in range(NV):
                            t = _digits_dot(e, dp, ws, *[[x[v] for x in xs] for xs in xd])
                            k = i * NV + v
                            sv = bb.fmul(scl, dxv[v])
                            acc[k] = e.fma(acc[k], bb.sitofp(t, V(F32, 16)), sv)
                            acc[R * NV + k] = e.fma(acc[R * NV + k], xsv[v], mnv)
                return acc

            accs = e.loop(nb_, [zero_f] * (2 * R * NV), step)
            for i in range(R):
                with bb.if_then(bb.icmp_signed("<", c(i), nr_)):
                    for v in range(NV):
                        k = i * NV + v
                        x = bb.fsub(accs[k], accs[R * NV + k])  # strict: no context reorders it
                        width = 1
                        while width < 2 * Cp:  # lane t * 2Cp then holds token t's sum
                            x = bb.fadd(x, e.shuffle(x, x, [min(L + width, 15) for L in range(16)]))
                            width *= 2
                        for t in range(Tv):
                            tok = v * Tv + t
                            with bb.if_then(bb.icmp_signed("<", c(tok), n_)):
                                at = bb.mul(bb.add(doff_, bb.add(bb.mul(c(tok), ld_), c(i))), c(4))
                                bb.store(bb.extract_element(x, I32(t * 2 * Cp)), e.ptr(db, at, F32), align=4)
            return context.get_dummy_value()

        i64 = types.int64
        return types.none(w, i64, i64, i64, i64, xt, i64, dl, sl, i64, dst, i64, i64, i64), codegen

    return row


# (isa, activation digits, T) -> the row intrinsic (lanes.py dispatches on T per expert)
KERNELS = {
    (isa, digits, T): _row_intrinsic(T, isa, rows[T], digits)
    for isa, rows in (("vnni", ROWS), ("generic", ROWS), ("avx2", ROWS_AVX2))
    for digits in (1, 2)
    for T in rows
}
