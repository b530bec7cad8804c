"""The attention's inner products as numba intrinsics (ops.attention): scores q.k over blocks of 16 (head,
position) pairs with one transposed reduction, and the value sums p.V with the output rows held in registers.

Plain numba loops (the earlier ops.attention) spent 80-100 cycles per (head, position) at head_dim 128 (AMD EPYC Zen 4):
each score ended in its own horizontal sum of a 16-lane vector, and each value row was added into `out` through
memory. Here:
- `qk{H}`: H query heads x P = 16 / H consecutive cached positions. Per 16 elements of head_dim: H loads of q,
  P widenings of float16 K (vcvtph2ps), 16 FMAs into 16 accumulators. At the end, one transposed reduction
  (4 levels of shuffle + add, 15 adds for the 16 sums) instead of 16 horizontal sums.
- `pv{H}x{C}`: H heads x 16 C output columns held in H C vector accumulators across all positions. Per
  position: C widened V chunks, one broadcast weight per head, H C FMAs. No loads or stores of `out` in the loop.

Summation order: each score is the sum over its lanes' partials, in a tree that is the same for every lane of
the block; each output is the sum over positions in order. A (head, position) score is the same bits whichever
block holds it, so a token gets the same attention whether it is decoded alone or inside a prefill chunk.
"""

from llvmlite import ir
from numba import types

from ._bits import intrinsic
from .simd import F32, I64, V, _c_array, _Emit

_HALF = ir.HalfType()


def _f16x16(e, base, elem):
    """16 IEEE halves at element `elem` of a uint16 array, widened to <16 x float>."""
    v = e.load(base, e.b.mul(elem, ir.Constant(I64, 2)), V(_HALF, 16), 2)
    return e.b.fpext(v, V(F32, 16))


def _transposed_sum(e, accs):
    """16 vectors of 16 floats -> one vector whose lane r is the sum of accs[r]'s lanes (the same tree for
    every r: lanes t and t + 8 first, then t and t + 4, t + 2, t + 1)."""
    level, w = list(accs), 16
    while len(level) > 1:
        r, h = 16 // w, w // 2  # results per vector, half their partial lanes
        lo = [k * w + t for k in range(r) for t in range(h)]
        hi = [k * w + h + t for k in range(r) for t in range(h)]
        level = [
            e.b.fadd(e.shuffle(a, b, lo + [16 + i for i in lo]), e.shuffle(a, b, hi + [16 + i for i in hi]))
            for a, b in zip(level[0::2], level[1::2])
        ]
        w = h
    return level[0]


def _qk(H):
    P = 16 // H

    @intrinsic
    def qk(typingctx, q, qo, kc, ko, s, so, sst, hd, scale):
        """s[so + hh sst + jj] = scale * (q[qo + hh hd:][:hd] . kc[ko + jj hd:][:hd]) for hh < H, jj < P; q and
        s float32, kc float16 bits (uint16), offsets in elements, hd a multiple of 16."""
        if not (_c_array(q, types.float32) and _c_array(kc, types.uint16) and _c_array(s, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            q_, qo_, kc_, ko_, s_, so_, sst_, hd_, sc_ = args
            qb, kb, sb = e.base(sig.args[0], q_), e.base(sig.args[2], kc_), e.base(sig.args[4], s_)
            c = lambda k: ir.Constant(I64, k)  # noqa: E731
            at = lambda o, stride, k, ci: builder.add(builder.add(o, builder.mul(stride, c(k))), ci)  # noqa: E731

            def step(i, accs):
                ci = builder.mul(i, c(16))
                qv = [e.load(qb, builder.mul(at(qo_, hd_, hh, ci), c(4)), V(F32, 16), 4) for hh in range(H)]
                kv = [_f16x16(e, kb, at(ko_, hd_, jj, ci)) for jj in range(P)]
                return [e.fma(accs[hh * P + jj], qv[hh], kv[jj]) for hh in range(H) for jj in range(P)]

            accs = e.loop(builder.sdiv(hd_, c(16)), [ir.Constant(V(F32, 16), [0.0] * 16)] * 16, step)
            tot = builder.fmul(_transposed_sum(e, accs), e.splat(sc_, 16))
            for hh in range(H):
                part = e.shuffle(tot, tot, list(range(hh * P, hh * P + P)))
                builder.store(part, e.ptr(sb, builder.mul(at(so_, sst_, hh, c(0)), c(4)), V(F32, P)), align=4)
            return context.get_dummy_value()

        i64 = types.int64
        return types.none(q, i64, kc, i64, s, i64, i64, i64, types.float32), codegen

    return qk


def _pv(H, C):
    @intrinsic
    def pv(typingctx, p, po, pst, vc, vo, n, hd, out, oo):
        """out[oo + hh hd + k] = sum over j < n, in order, of p[po + hh pst + j] * vc[vo + j hd + k], for hh < H,
        k < 16 C; p and out float32, vc float16 bits (uint16), offsets in elements."""
        if not (_c_array(p, types.float32) and _c_array(vc, types.uint16) and _c_array(out, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            p_, po_, pst_, vc_, vo_, n_, hd_, out_, oo_ = args
            pb, vb, ob = e.base(sig.args[0], p_), e.base(sig.args[3], vc_), e.base(sig.args[7], out_)
            c = lambda k: ir.Constant(I64, k)  # noqa: E731

            def step(j, accs):
                row = builder.add(vo_, builder.mul(j, hd_))
                vv = [_f16x16(e, vb, builder.add(row, c(16 * k))) for k in range(C)]
                new = []
                for hh in range(H):
                    at = builder.add(builder.add(po_, builder.mul(pst_, c(hh))), j)
                    pj = e.splat(e.load(pb, builder.mul(at, c(4)), F32, 4), 16)
                    new += [e.fma(accs[hh * C + k], pj, vv[k]) for k in range(C)]
                return new

            accs = e.loop(n_, [ir.Constant(V(F32, 16), [0.0] * 16)] * (H * C), step)
            for hh in range(H):
                for k in range(C):
                    at = builder.add(builder.add(oo_, builder.mul(hd_, c(hh))), c(16 * k))
                    builder.store(accs[hh * C + k], e.ptr(ob, builder.mul(at, c(4)), V(F32, 16)), align=4)
            return context.get_dummy_value()

        i64 = types.int64
        return types.none(p, i64, i64, vc, i64, i64, i64, out, i64), codegen

    return pv


qk4, qk2, qk1 = _qk(4), _qk(2), _qk(1)
pv4x4, pv2x4, pv1x4 = _pv(4, 4), _pv(2, 4), _pv(1, 4)  # 64 output columns
pv4x1, pv2x1, pv1x1 = _pv(4, 1), _pv(2, 1), _pv(1, 1)  # 16 (head_dim's rest after the 64s)
