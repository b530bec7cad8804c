"""The MoE prefill's few-token Q4_K product on AMX tiles (Intel AMX-INT8: Sapphire Rapids and later).

Same job as simd_lanes.py (a block of weight rows dotted with up to 16 tokens of one expert, the activations
int8.quantize_act's two digits), with the integer sums on the tile unit: per 32-element sub-block, one `tdpbusd`
multiplies 16 weight rows (tile A: 16 x 32 unsigned codes u, unpacked from the Q4_K nibbles once per row block and
super-block) by the 16 tokens' high digits (tile B: 8 x 64 bytes, lanes.pack_amx's layout) and one more by their low
digits; both 16 x 16 int32 results go through memory to vector registers, where 256 hi + lo (exact) is converted to f32
once and scaled, per row and token,
    acc += float(isum) * (d * sc_j * dx_t,j) - (dmin * m_j) * xs_t,j
One sub-block per tdpbusd: the Q4_K scales change every 32 elements, as the activation steps do.

Accuracy: the integer sums and float(isum) are exact, so the bound is simd_lanes.py's (tests/test_lanes.py):
    |out - W.x| <= sum_k A_k (dx_g(k)/2 + 4u|x_k|) + gamma_n sum_k A_k |x_k|,   u = 2^-24,  n = K/16 + 8.

Tiles: two C pairs (hi / lo) alternate between even and odd sub-blocks, and so do two A tiles, so sub-block j + 1's
products are issued before sub-block j's sums are read out (2026-12-01: 1.45x the vpdpbusd lanes for a 128-token MoE FFN
chunk; pipelining whole super-blocks was slower, and a dense product only matched int8.matmul's tiles).

The tile unit needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, once per process: `enable`) and a tile
configuration per thread (tiles_begin: ldtilecfg, before a thread's first call; tiles_end: tilerelease, after its
last, so the threads carry no tile state between kernel calls). Compiled only where the CPU has AMX-INT8 (lanes.isas
/ lanes.best_isa ask `enable()`), as its own cached kernel. lanes.best_isa uses it only when STREAM_RUN_AMX=1 (not
the default: slower on the full 30B-A3B file); STREAM_RUN_AMX=0 turns it off everywhere."""

from __future__ import annotations

import ctypes
import os

import numpy as np
from llvmlite import ir
from numba import types

from streamer.machine import cpu_flags

from ._bits import intrinsic
from .simd import F32, I8, I8P, I32, I64, V, _c_array, _Emit, _k4_scales

BLOCK = 144  # bytes of a Q4_K super-block
ROWS = 16  # weight rows per call: tile A's rows
# scratch bytes per thread: tile A's unpacked codes (16 rows x 256), two C buffers of 2 x 1 KiB, 16 x 8 f32 scales
# and mins, the 64-byte tile configuration
SCRATCH = 16 * 256 + 2 * 2048 + 2 * 16 * 8 * 4 + 64
_A, _C, _S, _M, _CFG = 0, 4096, 8192, 8192 + 512, 8192 + 1024


# tiles: C hi / lo of even sub-blocks, C hi / lo of odd ones (16 x 64 B), A of even / odd ones (16 x 32 B), B hi / lo
# (8 x 64 B): sub-block j + 1's products run while sub-block j's sums are read out
_CH, _CL, _AT, _BH, _BL = (0, 2), (1, 3), (4, 5), 6, 7


def config() -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for the tiles above."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for t in (*_CH, *_CL):
        rows[t], colsb[t] = 16, 64
    for t in _AT:
        rows[t], colsb[t] = 16, 32
    for t in (_BH, _BL):
        rows[t], colsb[t] = 8, 64
    return cfg


def _cpu_has_amx_int8() -> bool:
    return {"amx_int8", "amx_tile", "avx512bw"} <= cpu_flags()


_ENABLED: bool | None = None


def enable() -> bool:
    """Ask the kernel for the AMX tile state (Linux arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); True if
    this process may use the tiles. STREAM_RUN_AMX=0 says no."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = False
        if os.environ.get("STREAM_RUN_AMX", "1").strip() != "0" and _cpu_has_amx_int8():
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _ENABLED = libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
            except (OSError, AttributeError):
                _ENABLED = False
    return _ENABLED


# sub-block j's 32 codes in a row's 256 unpacked bytes: runs 0, 1 (and 2, 3) are loaded as 64 bytes, stored as
# their low nibbles (sub-blocks 0, 2) then their high nibbles (1, 3)
_POS = [(j // 4) * 128 + ((j // 2) % 2) * 32 + (j % 2) * 64 for j in range(8)]


@intrinsic
def tiles_begin(typingctx, scr, so):
    """Load the tile configuration at byte so + _CFG of scr (this thread's scratch): before a thread's first call."""
    if not _c_array(scr, types.uint8):
        return None

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        sb = e.base(sig.args[0], args[0])
        builder.call(e.declare("llvm.x86.ldtilecfg", ir.VoidType(), [I8P]), [builder.gep(sb, [e.off(args[1], _CFG)])])
        return context.get_dummy_value()

    return types.none(scr, types.int64), codegen


@intrinsic
def tiles_end(typingctx):
    """Release the tiles (tilerelease): after a thread's last call."""

    def codegen(context, builder, sig, args):
        builder.call(_Emit(context, builder).declare("llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def q4_k_amx_16(typingctx, w, off, row_bytes, nr, nb, bt, bo, dxv, xsv, lo, scr, so, dst, doff, ld, n):
    """(w, off, row_bytes, nr, nb, bt, bo, dxv, xsv, lo, scr, so, dst, doff, ld, n): the 16 Q4_K rows at byte
    off + i * row_bytes of w (rows past nr repeat row nr - 1 and are not stored; nb super-blocks each) dotted with
    the 16 token lanes packed at byte bo of bt (lanes.pack_amx: per sub-block, B hi then B lo, 512 bytes each),
    their dx / xs at f32 index lo of dxv / xsv (16 per sub-block); scr: this thread's SCRATCH bytes from so, the
    tiles configured (tiles_begin). dst[doff + t * ld + i] = row i's dot for token t < n."""
    if not (
        _c_array(w, types.uint8)
        and _c_array(bt, types.int8)
        and _c_array(dxv, types.float32)
        and _c_array(xsv, types.float32)
        and _c_array(scr, types.uint8)
        and _c_array(dst, types.float32)
    ):
        return None

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        bb = builder
        w_, off_, rb_, nr_, nb_, bt_, bo_, dxv_, xsv_, lo_, scr_, so_, dst_, doff_, ld_, n_ = args
        wb, btb = e.base(sig.args[0], w_), e.base(sig.args[5], bt_)
        dxb, xsb, sb, db = (e.base(sig.args[k], a) for k, a in ((7, dxv_), (8, xsv_), (10, scr_), (12, dst_)))
        c = lambda k: ir.Constant(I64, k)  # noqa: E731
        t8 = lambda k: ir.Constant(I8, k)  # noqa: E731
        tload = e.declare("llvm.x86.tileloadd64", ir.VoidType(), [I8, I8P, I64])
        tzero = e.declare("llvm.x86.tilezero", ir.VoidType(), [I8])
        tdp = e.declare("llvm.x86.tdpbusd", ir.VoidType(), [I8, I8, I8])
        tstore = e.declare("llvm.x86.tilestored64", ir.VoidType(), [I8, I8P, I64])
        abase = bb.add(so_, c(_A))
        last = bb.sub(nr_, c(1))
        roff = []
        for i in range(ROWS):
            ri = c(i)
            ri = bb.select(bb.icmp_signed(">", ri, last), last, ri)
            roff.append(bb.add(off_, bb.mul(ri, rb_)))
        lo_b = bb.mul(lo_, c(4))
        nib = e.const(I8, 64, 15)
        zero_f = ir.Constant(V(F32, 16), [0.0] * 16)
        eight = e.const(I32, 16, 8)

        def step(b, accs):
            bo = bb.mul(b, c(BLOCK))
            # unpack the 16 rows' codes of super-block b; their scales and mins (f32) to the scratch
            for i, ro in enumerate(roff):
                blk = bb.add(ro, bo)
                for k in range(0, BLOCK, 64):  # the row's super-block after next
                    e.prefetch(wb, bb.add(blk, c(2 * BLOCK + k)))
                d, dmin = e.f16x2(wb, blk)
                scales, mins = _k4_scales(e, wb, e.off(blk, 4))
                ds = bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8)))
                dm = bb.fmul(e.splat(dmin, 8), bb.uitofp(mins, V(F32, 8)))
                bb.store(ds, e.ptr(sb, bb.add(so_, c(_S + 32 * i)), V(F32, 8)), align=4)
                bb.store(dm, e.ptr(sb, bb.add(so_, c(_M + 32 * i)), V(F32, 8)), align=4)
                for h in range(2):
                    x = e.load(wb, e.off(blk, 16 + 64 * h), V(I8, 64), 1)
                    low = bb.and_(x, nib)
                    high = bb.and_(bb.lshr(x, e.const(I8, 64, 4)), nib)
                    at = bb.add(abase, c(256 * i + 128 * h))
                    bb.store(low, e.ptr(sb, at, V(I8, 64)), align=1)
                    bb.store(high, e.ptr(sb, e.off(at, 64), V(I8, 64)), align=1)
            acc = list(accs)

            def products(j):  # sub-block j's integer sums, into C buffer j % 2
                sub = bb.add(bb.mul(b, c(8)), c(j))  # sub-block index in the row
                bj = bb.add(bo_, bb.mul(sub, c(1024)))
                cb = bb.add(so_, c(_C + 2048 * (j % 2)))
                ch, cl, at = _CH[j % 2], _CL[j % 2], _AT[j % 2]
                bb.call(tload, [t8(at), bb.gep(sb, [bb.add(abase, c(_POS[j]))]), c(256)])
                bb.call(tload, [t8(_BH), bb.gep(btb, [bj]), c(64)])
                bb.call(tload, [t8(_BL), bb.gep(btb, [e.off(bj, 512)]), c(64)])
                bb.call(tzero, [t8(ch)])
                bb.call(tzero, [t8(cl)])
                bb.call(tdp, [t8(ch), t8(at), t8(_BH)])
                bb.call(tdp, [t8(cl), t8(at), t8(_BL)])
                bb.call(tstore, [t8(ch), bb.gep(sb, [cb]), c(64)])
                bb.call(tstore, [t8(cl), bb.gep(sb, [e.off(cb, 1024)]), c(64)])

            def readout(j):  # acc += the sums of sub-block j, scaled
                sub = bb.add(bb.mul(b, c(8)), c(j))
                cb = bb.add(so_, c(_C + 2048 * (j % 2)))
                la = bb.add(lo_b, bb.mul(sub, c(64)))
                dx = e.load(dxb, la, V(F32, 16), 4)
                xs = e.load(xsb, la, V(F32, 16), 4)
                for i in range(ROWS):
                    hi = e.load(sb, e.off(cb, 64 * i), V(I32, 16), 64)
                    lw = e.load(sb, e.off(cb, 1024 + 64 * i), V(I32, 16), 64)
                    isum = bb.add(bb.shl(hi, eight), lw)
                    s = e.splat(e.load(sb, bb.add(so_, c(_S + 32 * i + 4 * j)), F32, 4), 16)
                    m = e.splat(e.load(sb, bb.add(so_, c(_M + 32 * i + 4 * j)), F32, 4), 16)
                    a = e.fma(acc[i], bb.sitofp(isum, V(F32, 16)), bb.fmul(s, dx, flags=("fast",)))
                    acc[i] = bb.fsub(a, bb.fmul(m, xs, flags=("fast",)), flags=("fast",))

            products(0)
            for j in range(1, 8):
                products(j)
                readout(j - 1)
            readout(7)
            return acc

        accs = e.loop(nb_, [zero_f] * ROWS, step)
        # transpose: rows[t] = token t's 16 row dots (butterfly over lane blocks of 8, 4, 2, 1)
        m = list(accs)
        h = 8
        while h:
            for i in range(ROWS):
                if i & h:
                    continue
                a_, b_ = m[i], m[i + h]
                m[i] = e.shuffle(a_, b_, [L if not L & h else 16 + L - h for L in range(16)])
                m[i + h] = e.shuffle(a_, b_, [L + h if not L & h else 16 + L for L in range(16)])
            h //= 2
        lanes_i = ir.Constant(V(I64, 16), list(range(16)))
        keep = bb.icmp_signed("<", lanes_i, e.splat(nr_, 16))
        margs = [V(F32, 16), V(F32, 16).as_pointer(), I32, V(ir.IntType(1), 16)]
        mstore = e.declare("llvm.masked.store.v16f32.p0", ir.VoidType(), margs)
        for t in range(16):
            with bb.if_then(bb.icmp_signed("<", c(t), n_)):
                at = bb.mul(bb.add(doff_, bb.mul(c(t), ld_)), c(4))
                bb.call(mstore, [m[t], e.ptr(db, at, V(F32, 16)), I32(4), keep])
        return context.get_dummy_value()

    i64 = types.int64
    sig = types.none(w, i64, i64, i64, i64, bt, i64, dxv, xsv, i64, scr, i64, dst, i64, i64, i64)
    return sig, codegen
