"""The MoE prefill's few-token Q4_K product: each weight row read once, dotted with up to 16 tokens in lanes.

At 128 prefill tokens an expert gets about 8 of them. simd_i8.py's tile kernel then spends more time unpacking
each 32-row weight tile into its transposed byte layout (7-10 us from RAM) than multiplying it (2.6 us per 4
tokens), and the decode row dot (simd_vnni.py) redoes the nibble and scale work per token. Here the weights stay
in their Q4_K rows, read front to back, and the activations are the ones transposed (once per expert, by
lanes.pack, which is cheap: T tokens x 2K bytes against 2.6 MB of the expert's weights).

Lanes: T = 16 / C tokens (T = 16, 8, 4, 2), lane t * C + c' holds token t's chunk c' (4 elements) of a run of C
chunks. A 32-byte run of qs holds elements 0..31 of sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles);
4C bytes of it broadcast to the T lane groups (one dword load, one shuffle) and masked with 0x0F and 0xF0 are
the unsigned weight codes u (and 16 u) of chunks Cs..Cs+C-1 of both sub-blocks for every token at once, so one
vpdpbusd per activation digit covers 16 lanes x 4 products with no transposed weights. Per sub-block j:
8/C vectors per digit, summed in int32 as 256 * sum(u * hi) + sum(u * lo) (exact: |isum| < 2^28, and a
multiple of 16 beyond 2^24 for the high nibbles, whose 16 u is undone by the exact scale d * sc_j / 16), then
    acc += float(isum) * (d * sc_j * dx_t,j),   accm += dmin * m_j * xs_t,j   (xs only in lane c' = 0)
per lane in f32, and at the row's end each token's C lanes are added up (a shuffle tree).

Accuracy: the activations are int8.quantize_act's (two digits per element, q = rint(x / dx), dx = max|x| /
32639 per 32 elements, xs the exact f32 sums), the integer sums exact and float(isum) exact, so the bound is
simd_i8.py's tile kernel's, only the f32 summation order differs:
    |out - W.x| <= sum_k A_k (dx_g(k)/2 + 4u|x_k|) + gamma_n sum_k A_k |x_k|,   u = 2^-24,
with A_k = |w_k| plus the min term's magnitude and n = K + K/16 + 8 (tests/test_lanes.py checks it against
gguf-py in float64). A token's result depends on its own lanes only, and on C (the summation order): the caller
picks C from the expert's token count alone, so it is the same for every cache state (streamed == resident).

Instruction sets as simd_i8.py: "vnni" (vpdpbusd) or "generic" (plain vector IR), chosen in Python (lanes.py).
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import F32, I8, I32, I64, V, _c_array, _Emit, _k4_scales
from .simd_i8 import _dp_generic, _dp_vnni

BLOCK = 144  # bytes of a Q4_K super-block
# weight rows per call, by C: they share each activation vector load (one row per load was load-bound); more
# rows at C = 1, 2 spill registers
ROWS = {1: 2, 2: 2, 4: 4, 8: 4}


def _row_intrinsic(C, dp, R):
    """Intrinsic `(w, off, row_bytes, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)`: the R Q4_K rows at byte
    off + i * row_bytes of w (i < R; rows past nr repeat row nr - 1 and are not stored; nb super-blocks each)
    dotted with the T = 16 / C tokens packed at byte xo of xt (lanes.pack's layout: per sub-block g, vector
    s < 8 / C, digit d: 64 bytes) with dx / xs lanes at f32 index lo of dl / sl (16 per sub-block):
    dst[doff + t * ld + i] = row i's dot for token t < n. The R rows share each activation vector load."""
    n_vec = 8 // C  # vectors per sub-block and digit
    T = 16 // C

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
            zero_i = ir.Constant(V(I32, 16), [0] * 16)
            eight = e.const(I32, 16, 8)
            masks = (e.const(I8, 64, 15), e.const(I8, 64, -16))
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
                dsc, dmn = [], []
                # the next R rows (contiguous after these), R super-blocks' bytes per step: read by the time
                # these rows are done
                ahead = bb.add(bb.add(off_, bb.mul(rb_, c(R))), bb.mul(b, c(R * BLOCK)))
                for k in range(0, R * BLOCK, 64):
                    e.prefetch(wb, e.off(ahead, k))
                for blk in blks:
                    d, dmin = e.f16x2(wb, blk)
                    scales, mins = _k4_scales(e, wb, e.off(blk, 4))
                    ds = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
                    # the high nibbles are taken as 16 u: their scale / 16 (exact)
                    dsc.append(bb.fmul(ds, ir.Constant(V(F32, 8), [1.0, 0.0625] * 4)))
                    dmn.append(bb.fmul(e.splat(dmin, 8), bb.uitofp(mins, V(F32, 8))))
                acc, accm = list(accs[:R]), list(accs[R:])
                for cc in range(4):
                    for nib in range(2):
                        j = 2 * cc + nib  # sub-block
                        g = bb.add(bb.mul(b, c(8)), c(j))  # sub-block index in the row
                        xg = bb.add(xo_, bb.mul(g, c(128 * n_vec)))
                        xh = [e.load(xb, bb.add(xg, c(128 * s)), V(I8, 64), 1) for s in range(n_vec)]
                        xl = [e.load(xb, bb.add(xg, c(128 * s + 64)), V(I8, 64), 1) for s in range(n_vec)]
                        lat = bb.add(lo_b, bb.mul(g, c(64)))
                        dxv = e.load(dlb, lat, V(F32, 16), 4)
                        xsv = e.load(slb, lat, V(F32, 16), 4)
                        for i, blk in enumerate(blks):
                            ws = []
                            for s in range(n_vec):
                                at = e.off(blk, 16 + 32 * cc + 4 * C * s)
                                raw = e.load(wb, at, V(I32, C) if C > 1 else I32)
                                v = e.shuffle(raw, raw, [k % C for k in range(16)]) if C > 1 else e.splat(raw, 16)
                                ws.append(bb.and_(bb.bitcast(v, V(I8, 64)), masks[nib]))
                            t = zero_i
                            for s in range(n_vec):
                                t = dp(e, t, ws[s], xh[s])
                            t = bb.shl(t, eight)
                            for s in range(n_vec):
                                t = dp(e, t, ws[s], xl[s])
                            scl = bb.fmul(e.shuffle(dsc[i], dsc[i], [j] * 16), dxv, flags=("fast",))
                            acc[i] = e.fma(acc[i], bb.sitofp(t, V(F32, 16)), scl)
                            accm[i] = e.fma(accm[i], xsv, e.shuffle(dmn[i], dmn[i], [j] * 16))
                return acc + accm

            accs = e.loop(nb_, [zero_f] * (2 * R), step)
            for i in range(R):
                v = bb.fsub(accs[i], accs[R + i], flags=("fast",))
                width = 1
                while width < C:  # lane t * C then holds token t's sum
                    v = bb.fadd(v, e.shuffle(v, v, [min(k + width, 15) for k in range(16)]), flags=("fast",))
                    width *= 2
                with bb.if_then(bb.icmp_signed("<", c(i), nr_)):
                    for t in range(T):
                        with bb.if_then(bb.icmp_signed("<", c(t), n_)):
                            at = bb.mul(bb.add(doff_, bb.add(bb.mul(c(t), ld_), c(i))), c(4))
                            bb.store(bb.extract_element(v, I32(t * C)), e.ptr(db, at, F32), align=4)
            return context.get_dummy_value()

        i64 = types.int64
        return types.none(w, i64, i64, i64, i64, xt, i64, dl, sl, i64, dst, i64, i64, i64), codegen

    return row


# q4_k_lanes_<isa>_<C>: module globals for numba (lanes.py picks one per expert).
CS = (1, 2, 4, 8)
for _isa, _dp in (("vnni", _dp_vnni), ("generic", _dp_generic)):
    for _C in CS:
        globals()[f"q4_k_lanes_{_isa}_{_C}"] = _row_intrinsic(_C, _dp, ROWS[_C])
