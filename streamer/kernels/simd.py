"""Row dot products of the block formats against int16-quantized activations, as numba intrinsics.

Why intrinsics: numba widens every small-integer operation to int64 and LLVM then reduces each
inner loop horizontally, which left the plain-numba block kernels at 3-6 GB/s. These emit one
loop of generic LLVM vector IR per row, with the accumulators in registers across blocks and the
ggml vec_dot shape: int16 products summed pairwise into int32 (x86 lowers it to vpmaddwd, or
vpdpwssd with AVX512-VNNI), converted to f32 once per block with the block scale. Generic IR
keeps them portable: LLVM picks the instructions for the host.

Each function `<fmt>_dot(w, off, xq, dx, xs, nb, pf)` returns the f32 dot of the row starting at
byte `off` of `w` (nb blocks) with x ~= xq * dx (xq int16 [n_in], dx f32 per 32 or 256 elements;
xs f32 sums of x per 32, for the Q4_K/Q5_K mins). `pf` is a prefetch distance in bytes.
"""

from llvmlite import ir
from numba import types

from . import cpu
from ._bits import declare, intrinsic

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
I8P = I8.as_pointer()


def V(t, n):
    return ir.VectorType(t, n)


def _c_array(a, dtype):
    # The intrinsics index raw memory: accept only C-contiguous arrays of the expected dtype.
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"


class _Emit:
    """Small vector-IR vocabulary over one llvmlite builder."""

    def __init__(self, context, builder):
        self.c, self.b = context, builder

    def base(self, aryty, ary):  # i8* to an array's data
        return self.b.bitcast(self.c.make_array(aryty)(self.c, self.b, ary).data, I8P)

    def ptr(self, base, byte_off, ty):
        return self.b.bitcast(self.b.gep(base, [byte_off]), ty.as_pointer())

    def load(self, base, byte_off, ty, align=1):
        return self.b.load(self.ptr(base, byte_off, ty), align=align)

    def off(self, v, k):  # v + k for i64 offsets
        return self.b.add(v, ir.Constant(I64, k))

    def f16x2(self, base, byte_off):
        """The two IEEE halves in the 4 bytes at byte_off, as f32 (vmovd + vcvtph2ps). A lone i16
        load became vpinsrw into a live register, chaining every block's scale to the accumulator."""
        b = self.b
        # An empty asm keeps the load whole (LLVM would narrow it to i16 and vpinsrw it again).
        u = b.call(ir.InlineAsm(ir.FunctionType(I32, [I32]), "", "=r,0"), [self.load(base, byte_off, I32)])
        v = b.insert_element(ir.Constant(V(I32, 4), [0] * 4), u, I32(0))
        v = b.bitcast(v, V(ir.HalfType(), 8))
        f = b.fpext(self.shuffle(v, v, [0, 1, 2, 3]), V(F32, 4))
        return b.extract_element(f, I32(0)), b.extract_element(f, I32(1))

    def declare(self, name, ret, args):
        """The module's declaration of function `name` (an LLVM intrinsic), added on first use."""
        return declare(self.b.module, name, ret, args)

    def opaque(self, v):
        """v unchanged, through an empty asm (x86): LLVM cannot then sink a widening of v past the shuffles that use
        it. It moved the K-quant scales' sext behind every per-32 shuffle: a byte shuffle plus a widening per use
        instead of one word shuffle."""
        if not cpu.X86:
            return v
        return self.b.call(ir.InlineAsm(ir.FunctionType(v.type, [v.type]), "", "=v,0"), [v])

    def splat(self, v, n):
        t = V(v.type, n)
        u = self.b.insert_element(ir.Constant(t, ir.Undefined), v, ir.Constant(I32, 0))
        return self.b.shuffle_vector(u, ir.Constant(t, ir.Undefined), ir.Constant(V(I32, n), [0] * n))

    def const(self, t, n, k):
        return ir.Constant(V(t, n), [k] * n)

    def shuffle(self, a, b, mask):
        return self.b.shuffle_vector(a, b, ir.Constant(V(I32, len(mask)), mask))

    def pairdot(self, a16, b16):
        """<32 x i16> . <32 x i16> -> <16 x i32> adjacent-pair sums (vpmaddwd)."""
        m = self.b.mul(self.b.sext(a16, V(I32, 32)), self.b.sext(b16, V(I32, 32)))
        u = ir.Constant(V(I32, 32), ir.Undefined)
        return self.b.add(self.shuffle(m, u, list(range(0, 32, 2))), self.shuffle(m, u, list(range(1, 32, 2))))

    def fma(self, acc, a, b):
        """acc + a * b, fused (llvm.fma): the same rounding wherever LLVM inlines the code. A fast-math fadd(fmul)
        was contracted, or not, and reassociated by what surrounded it: the same row dot gave other bits in
        experts_matvec than in grouped_gate_up (tests/test_moe_prefill.py), depending on compile history."""
        t = acc.type
        name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
        return self.b.call(self.declare(name, t, [t] * 3), [a, b, acc])

    def hsum(self, v):
        """Tree sum of a float vector, in exactly this order (no fast-math flags, which _bits.intrinsic keeps numba
        from adding: LLVM may not reassociate it, so it gives the same bits in every kernel it is inlined into; once
        per row, so its cost does not matter)."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuffle(v, v, list(range(n))), self.shuffle(v, v, list(range(n, 2 * n))))
        return self.b.extract_element(v, ir.Constant(I32, 0))

    def prefetch(self, base, byte_off):
        fn = self.declare("llvm.prefetch.p0", ir.VoidType(), [I8P, I32, I32, I32])
        self.b.call(fn, [self.b.gep(base, [byte_off]), I32(0), I32(2), I32(1)])

    def loop(self, n, carried, body):
        """for i in range(n): carried = body(i, carried) -- with the carried values as SSA phis."""
        b = self.b
        pre = b.block
        head, step, done = b.append_basic_block("head"), b.append_basic_block("step"), b.append_basic_block("done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(ir.Constant(I64, 0), pre)
        phis = []
        for v in carried:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        b.cbranch(b.icmp_signed("<", i, n), step, done)
        b.position_at_end(step)
        new = body(i, phis)
        end = b.block
        i.add_incoming(b.add(i, ir.Constant(I64, 1)), end)
        for p, v in zip(phis, new):
            p.add_incoming(v, end)
        b.branch(head)
        b.position_at_end(done)
        return phis


class SplitBody:
    """A per-block row-dot body in two parts: weights(e, wb, blk) -> W, the values taken from the weights alone,
    and token(e, W, xq, dx, xs, b, accs) -> accs. Called as a plain body it runs both; _row_intrinsic with
    n_tok > 1 runs weights once per block and token per token, so each token's operations, and its bits, are
    the one-token dot's."""

    def __init__(self, weights, token):
        self.weights, self.token = weights, token

    def __call__(self, e, wb, xqb, dxb, xsb, b, blk, accs):
        return self.token(e, self.weights(e, wb, blk), xqb, dxb, xsb, b, accs)


def _row_intrinsic(block_bytes, body_fn, n_acc, x_dtype=types.int16, n_vec=1, n_rows=1, block_stride=None, n_tok=1):
    """Wrap a per-block body into an intrinsic `(w, off, xq, dx, xs, nb, pf) -> f32`.

    body_fn(e, wb, xq, dx, xs, b, blk, accs) -> accs; accs are n_vec <16 x f32> vectors summed at the end and, if
    n_acc == 2, one <8 x f32> subtracted (the K-quant mins). x_dtype: int16 activations, or int8 digits
    (simd_vnni.py). body_fn may instead map activation dtypes to bodies, or to (body, its own n_vec): xq's dtype then
    picks the body when it is compiled (simd_vnni.py: int8 = two digits, uint8 = one). n_rows = 2: `(w, off, stride,
    xq, dx, xs, nb, pf) -> (f32, f32)`, the rows at off and off + stride in one loop (activation loads shared: 4-6%
    faster on Zen 4); LLVM may order each row's fast-math sums otherwise than the one-row intrinsic, so callers keep
    the pairing of a row fixed (blocks.dot2). n_rows > 2: the rows at off + r stride, an n_rows-tuple. block_stride:
    bytes from one block of a row to its next (default block_bytes). n_tok = 2 or 3: `(w, off, stride, xq_0, dx_0,
    xs_0, ..., xq_{n_tok-1}, dx_{n_tok-1}, xs_{n_tok-1}, nb, pf)` -> the n_rows * n_tok dots, row by row: the rows
    read once for n_tok tokens, a SplitBody's weights part once per block (kernels/grouped.py). Each dot has the
    operations of the one-token intrinsic's, in its order."""
    bstride = block_bytes if block_stride is None else block_stride
    bodies = body_fn if isinstance(body_fn, dict) else {x_dtype: body_fn}

    def typed(w, xq, dx, xs):
        return (
            _c_array(w, types.uint8)
            and any(_c_array(xq, t) for t in bodies)
            and _c_array(dx, types.float32)
            and _c_array(xs, types.float32)
        )

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        w_, off_ = args[:2]
        nb_, pf_ = args[-2:]
        offs = [off_] + [builder.add(off_, builder.mul(args[2], ir.Constant(I64, r))) for r in range(1, n_rows)]
        wb = e.base(sig.args[0], w_)
        at = len(sig.args) - 2 - 3 * n_tok  # the tokens' (xq, dx, xs), in order
        xdt = sig.args[at].dtype
        toks = [tuple(e.base(sig.args[k], args[k]) for k in range(at + 3 * j, at + 3 * j + 3)) for j in range(n_tok)]
        body, nv = bodies[xdt], n_vec
        if isinstance(body, tuple):
            body, nv = body
        one = [ir.Constant(V(F32, 16), [0.0] * 16)] * nv + [ir.Constant(V(F32, 8), [0.0] * 8)] * (n_acc - 1)
        k = len(one)

        def step(b, accs):
            new = []
            for r, o in enumerate(offs):
                blk = builder.add(o, builder.mul(b, ir.Constant(I64, bstride)))
                if r == 0 or bstride == block_bytes:  # interleaved rows: row 0's prefetches cover the group
                    for j in range(0, block_bytes if bstride == block_bytes else bstride, 64):
                        e.prefetch(wb, builder.add(blk, builder.add(pf_, ir.Constant(I64, j))))
                W = body.weights(e, wb, blk) if isinstance(body, SplitBody) else None  # once for the tokens
                for j, (xqb, dxb, xsb) in enumerate(toks):
                    acc = accs[(r * n_tok + j) * k : (r * n_tok + j + 1) * k]
                    new += (
                        body(e, wb, xqb, dxb, xsb, b, blk, acc)
                        if W is None
                        else body.token(e, W, xqb, dxb, xsb, b, acc)
                    )
            return new

        accs = e.loop(nb_, one * (n_rows * n_tok), step)
        res = []
        for r in range(n_rows * n_tok):
            a = accs[r * k : (r + 1) * k]
            v = a[0]
            for u in a[1:nv]:
                v = builder.fadd(v, u)  # strict, as hsum: the same bits in every kernel
            total = e.hsum(v)
            if n_acc == 2:
                total = builder.fsub(total, e.hsum(a[nv]))
            res.append(total)
        if len(res) == 1:
            return res[0]
        return context.make_tuple(builder, sig.return_type, res)

    i64 = types.int64
    if n_rows == 1 and n_tok == 1:

        @intrinsic
        def row(typingctx, w, off, xq, dx, xs, nb, pf):
            return types.float32(w, i64, xq, dx, xs, i64, i64) if typed(w, xq, dx, xs) else None, codegen

        return row

    if n_tok == 1:

        @intrinsic
        def rows(typingctx, w, off, stride, xq, dx, xs, nb, pf):
            sig = types.UniTuple(types.float32, n_rows)(w, i64, i64, xq, dx, xs, i64, i64)
            return sig if typed(w, xq, dx, xs) else None, codegen

        return rows

    def tok_sig(w, xs3):
        same = all(a == xs3[0] for a in xs3[0::3]) and all(typed(w, *xs3[3 * j : 3 * j + 3]) for j in range(n_tok))
        return types.UniTuple(types.float32, n_rows * n_tok)(w, i64, i64, *xs3, i64, i64) if same else None

    if n_tok == 2:

        @intrinsic
        def rows_t2(typingctx, w, off, stride, q0, d0, s0, q1, d1, s1, nb, pf):
            return tok_sig(w, (q0, d0, s0, q1, d1, s1)), codegen

        return rows_t2

    assert n_tok == 3

    @intrinsic
    def rows_t3(typingctx, w, off, stride, q0, d0, s0, q1, d1, s1, q2, d2, s2, nb, pf):
        return tok_sig(w, (q0, d0, s0, q1, d1, s1, q2, d2, s2)), codegen

    return rows_t3


def _q8_0(e, wb, xqb, dxb, xsb, b, blk, accs):
    # block_q8_0: d, int8 qs[32]
    bb = e.b
    s = bb.fmul(e.f16x2(wb, blk)[0], e.load(dxb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
    wv = bb.sext(e.load(wb, e.off(blk, 2), V(I8, 32)), V(I16, 32))
    xv = e.load(xqb, bb.mul(b, ir.Constant(I64, 64)), V(I16, 32), 2)
    p = bb.sitofp(e.pairdot(wv, xv), V(F32, 16))
    return [e.fma(accs[0], p, e.splat(s, 16))]


def _q4_0(e, wb, xqb, dxb, xsb, b, blk, accs):
    # block_q4_0: d, qs[16]; element l = low nibble of qs[l], element l+16 = high nibble; value q-8
    bb = e.b
    s = bb.fmul(e.f16x2(wb, blk)[0], e.load(dxb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
    q = e.load(wb, e.off(blk, 2), V(I8, 16))
    q = e.shuffle(bb.and_(q, e.const(I8, 16, 15)), bb.lshr(q, e.const(I8, 16, 4)), list(range(32)))
    wv = bb.sext(bb.sub(q, e.const(I8, 32, 8)), V(I16, 32))
    xv = e.load(xqb, bb.mul(b, ir.Constant(I64, 64)), V(I16, 32), 2)
    p = bb.sitofp(e.pairdot(wv, xv), V(F32, 16))
    return [e.fma(accs[0], p, e.splat(s, 16))]


def _k4_scales(e, wb, at):
    """ggml get_scale_min_k4 for all 8 sub-blocks at once: (<8 x i8> scales, <8 x i8> mins)."""
    bb = e.b
    u0, u1, u2 = (e.load(wb, e.off(at, k), I32) for k in (0, 4, 8))
    m6, m4, m2 = I32(0x3F3F3F3F), I32(0x0F0F0F0F), I32(0x03030303)
    sc_hi = bb.or_(bb.and_(u2, m4), bb.shl(bb.and_(bb.lshr(u0, I32(6)), m2), I32(4)))
    mn_hi = bb.or_(bb.and_(bb.lshr(u2, I32(4)), m4), bb.shl(bb.and_(bb.lshr(u1, I32(6)), m2), I32(4)))

    def pack(lo, hi):
        v = bb.insert_element(ir.Constant(V(I32, 2), ir.Undefined), lo, I32(0))
        return bb.bitcast(bb.insert_element(v, hi, I32(1)), V(I8, 8))

    return pack(bb.and_(u0, m6), sc_hi), pack(bb.and_(u1, m6), mn_hi)


def _kquant_mins(e, xsb, b, dmin, mins, acc):
    # acc_min += dmin * m_j * sum(x over sub-block j), in float (exact x sums, no quantization)
    bb = e.b
    xs8 = e.load(xsb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    mf = bb.uitofp(mins, V(F32, 8))
    return e.fma(acc, bb.fmul(mf, xs8), e.splat(dmin, 8))


def _q45_k(qs_at, has_qh):
    def body(e, wb, xqb, dxb, xsb, b, blk, accs):
        # block_q4_K / block_q5_K: d, dmin, scales[12], (qh[32]), qs[128]
        bb = e.b
        d, dmin = e.f16x2(wb, blk)
        scales, mins = _k4_scales(e, wb, e.off(blk, 4))
        # Bytes widened to words once per 32 (then nibbles and the fifth bits are word shifts and masks), each
        # sub-block's scale one word broadcast.
        w16 = V(I16, 32)
        qh = bb.zext(e.load(wb, e.off(blk, 16), V(I8, 32)), w16) if has_qh else None
        sw = e.opaque(bb.zext(scales, V(I16, 8)))
        xb = bb.mul(b, ir.Constant(I64, 512))  # 256 int16
        isum = ir.Constant(V(I32, 16), [0] * 16)
        for c in range(4):
            q = bb.zext(e.load(wb, e.off(blk, qs_at + 32 * c), V(I8, 32)), w16)
            lo, hi = bb.and_(q, e.const(I16, 32, 15)), bb.lshr(q, e.const(I16, 32, 4))
            if has_qh:  # bit 2c of qh[l] is bit 4 of sub-block 2c, bit 2c+1 of sub-block 2c+1
                for k in range(2):
                    t = 2 * c + k
                    b5 = bb.shl(qh, e.const(I16, 32, 4 - t)) if t < 4 else bb.lshr(qh, e.const(I16, 32, t - 4))
                    b5 = bb.and_(b5, e.const(I16, 32, 16))
                    lo, hi = (bb.or_(lo, b5), hi) if k == 0 else (lo, bb.or_(hi, b5))
            for j, v in ((2 * c, lo), (2 * c + 1, hi)):
                xv = e.load(xqb, e.off(xb, 64 * j), V(I16, 32), 2)
                isum = bb.add(isum, e.pairdot(bb.mul(v, e.shuffle(sw, sw, [j] * 32)), xv))
        s = bb.fmul(d, e.load(dxb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
        acc = e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(s, 16))
        return [acc, _kquant_mins(e, xsb, b, dmin, mins, accs[1])]

    return body


def _q6_k_values(e, wb, blk):
    """block_q6_K's 256 six-bit values, as (half h, group k, int8 x 32 of q - 32) for elements
    128h + 32k .. +31: the low 4 bits from ql, the top 2 from qh (ggml's dequantize_row_q6_K order)."""
    bb = e.b
    for h in range(2):
        ql0 = e.load(wb, e.off(blk, 64 * h), V(I8, 32))
        ql1 = e.load(wb, e.off(blk, 64 * h + 32), V(I8, 32))
        qh = e.load(wb, e.off(blk, 128 + 32 * h), V(I8, 32))
        for k, (ql, shift) in enumerate(((ql0, 0), (ql1, 0), (ql0, 4), (ql1, 4))):
            nib = bb.and_(bb.lshr(ql, e.const(I8, 32, shift)), e.const(I8, 32, 15))
            top = bb.shl(bb.and_(bb.lshr(qh, e.const(I8, 32, 2 * k)), e.const(I8, 32, 3)), e.const(I8, 32, 4))
            yield h, k, bb.sub(bb.or_(nib, top), e.const(I8, 32, 32))


def _q6_k(e, wb, xqb, dxb, xsb, b, blk, accs):
    # block_q6_K: ql[128], qh[64], int8 scales[16], d; value d * scale[e // 16] * (q - 32)
    bb = e.b
    scales = e.opaque(bb.sext(e.load(wb, e.off(blk, 192), V(I8, 16)), V(I16, 16)))
    xb = bb.mul(b, ir.Constant(I64, 512))
    isum = ir.Constant(V(I32, 16), [0] * 16)
    for h, k, q8 in _q6_k_values(e, wb, blk):
        q = bb.sext(q8, V(I16, 32))
        g = 8 * h + 2 * k  # scales of elements 0-15 and 16-31 of this 32-group
        sc = e.shuffle(scales, scales, [g] * 16 + [g + 1] * 16)
        xv = e.load(xqb, e.off(xb, 2 * (128 * h + 32 * k)), V(I16, 32), 2)
        isum = bb.add(isum, e.pairdot(bb.mul(q, sc), xv))
    s = bb.fmul(e.f16x2(wb, e.off(blk, 206))[1], e.load(dxb, bb.mul(b, ir.Constant(I64, 4)), F32, 4))
    return [e.fma(accs[0], bb.sitofp(isum, V(F32, 16)), e.splat(s, 16))]


q8_0_dot = _row_intrinsic(34, _q8_0, 1)
q4_0_dot = _row_intrinsic(18, _q4_0, 1)
q4_k_dot = _row_intrinsic(144, _q45_k(16, False), 2)
q4_k_dot2 = _row_intrinsic(144, _q45_k(16, False), 2, n_rows=2)  # two rows per call (blocks.dot2)
q5_k_dot = _row_intrinsic(176, _q45_k(48, True), 2)
q6_k_dot = _row_intrinsic(210, _q6_k, 1)


# ---- exact row dequantization (matmul tiles, embedding rows) -----------------------------
# Same operation order as ggml/gguf-py, so values are bit-identical: products of a scale and a
# small integer are exact in f32; only the final scale*q (and the Q4_K/Q5_K "- dmin*m") rounds.


def _deq_intrinsic(block_bytes, block_elems, body_fn):
    """Intrinsic `(w, off, dst, doff, nb)`: write nb blocks of the row at byte off of w as f32
    into dst starting at flat element doff. body_fn(e, wb, blk, store) calls store(k, <n x f32>)."""

    @intrinsic
    def deq(typingctx, w, off, dst, doff, nb):
        if not (_c_array(w, types.uint8) and _c_array(dst, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            w_, off_, dst_, doff_, nb_ = args
            wb, db = e.base(sig.args[0], w_), e.base(sig.args[2], dst_)
            dbase = builder.mul(doff_, ir.Constant(I64, 4))

            def step(b, carried):
                blk = builder.add(off_, builder.mul(b, ir.Constant(I64, block_bytes)))
                at = builder.add(dbase, builder.mul(b, ir.Constant(I64, 4 * block_elems)))

                def store(k, v):  # v: f32 vector for elements k.. of this block
                    builder.store(v, e.ptr(db, e.off(at, 4 * k), v.type), align=4)

                body_fn(e, wb, blk, store)
                return carried

            e.loop(nb_, [], step)
            return context.get_dummy_value()

        return types.none(w, types.int64, dst, types.int64, types.int64), codegen

    return deq


def _deq_q8_0(e, wb, blk, store):
    bb = e.b
    q = bb.sitofp(e.load(wb, e.off(blk, 2), V(I8, 32)), V(F32, 32))
    store(0, bb.fmul(e.splat(e.f16x2(wb, blk)[0], 32), q))


def _deq_q4_0(e, wb, blk, store):
    bb = e.b
    q = e.load(wb, e.off(blk, 2), V(I8, 16))
    q = e.shuffle(bb.and_(q, e.const(I8, 16, 15)), bb.lshr(q, e.const(I8, 16, 4)), list(range(32)))
    q = bb.sitofp(bb.sub(q, e.const(I8, 32, 8)), V(F32, 32))
    store(0, bb.fmul(e.splat(e.f16x2(wb, blk)[0], 32), q))


def _deq_q45_k(qs_at, has_qh):
    def body(e, wb, blk, store):
        bb = e.b
        d, dmin = e.f16x2(wb, blk)
        scales, mins = _k4_scales(e, wb, e.off(blk, 4))
        dsc = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
        dmn = bb.fmul(e.splat(dmin, 8), bb.uitofp(mins, V(F32, 8)))
        qh = e.load(wb, e.off(blk, 16), V(I8, 32)) if has_qh else None
        for c in range(4):
            q = e.load(wb, e.off(blk, qs_at + 32 * c), V(I8, 32))
            lo, hi = bb.and_(q, e.const(I8, 32, 15)), bb.lshr(q, e.const(I8, 32, 4))
            if has_qh:
                lo = bb.or_(
                    lo, bb.shl(bb.and_(bb.lshr(qh, e.const(I8, 32, 2 * c)), e.const(I8, 32, 1)), e.const(I8, 32, 4))
                )
                hi = bb.or_(
                    hi, bb.shl(bb.and_(bb.lshr(qh, e.const(I8, 32, 2 * c + 1)), e.const(I8, 32, 1)), e.const(I8, 32, 4))
                )
            for j, v in ((2 * c, lo), (2 * c + 1, hi)):
                s = e.shuffle(dsc, dsc, [j] * 32)
                m = e.shuffle(dmn, dmn, [j] * 32)
                store(32 * j, bb.fsub(bb.fmul(s, bb.uitofp(v, V(F32, 32))), m))

    return body


def _deq_q6_k(e, wb, blk, store):
    bb = e.b
    d = e.f16x2(wb, e.off(blk, 206))[1]
    dsc = bb.fmul(e.splat(d, 16), bb.sitofp(e.load(wb, e.off(blk, 192), V(I8, 16)), V(F32, 16)))
    for h, k, q8 in _q6_k_values(e, wb, blk):
        g = 8 * h + 2 * k
        store(128 * h + 32 * k, bb.fmul(e.shuffle(dsc, dsc, [g] * 16 + [g + 1] * 16), bb.sitofp(q8, V(F32, 32))))


q8_0_deq = _deq_intrinsic(34, 32, _deq_q8_0)
q4_0_deq = _deq_intrinsic(18, 32, _deq_q4_0)
q4_k_deq = _deq_intrinsic(144, 256, _deq_q45_k(16, False))
q5_k_deq = _deq_intrinsic(176, 256, _deq_q45_k(48, True))
q6_k_deq = _deq_intrinsic(210, 256, _deq_q6_k)
