#!/usr/bin/env python3
"""Q4_K decode row dot (vpdpbusd over int8 activation digits): rows per call and an interleaved layout.

    python bench/interleave_bench.py [--rounds 5] [--shapes 2048x768,768x2048,151936x2048]

Variants, each a prange over groups of R rows calling simd's row intrinsic built from simd_vnni's Q4_K body:
  rows2     R = 2, rows as in the file (today's blocks.dot2)
  rows4     R = 4, rows as in the file (four streams, the activation loads shared by four rows)
  ilv2/4/8  R rows interleaved block by block (super-block b of rows g R .. g R + R - 1 adjacent: one stream,
            as llama.cpp's repacked q4_K_8x8 keeps 8 rows together), the same arithmetic per row
Per shape: ns per (row, super-block) on one thread with the matrix in L2 (compute bound: 64 rows repeated; the
thread's CPU time, so other processes taking the core do not count), and
GB/s on 1 and 2 threads over the whole matrix from RAM; best of alternating rounds. Each variant's outputs are
checked against rows2's (f32 rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import prange, types

from streamer.kernels import blocks, set_threads
from streamer.kernels._bits import FASTMATH
from streamer.kernels.simd import F32, I8, I32, I64, V, _k4_scales, _row_intrinsic
from streamer.kernels.simd_i8 import _dp_vnni
from streamer.kernels.simd_vnni import SB_BYTES, _q4_k_vnni_body

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kernels import make_weight  # noqa: E402

BB = 144
PF = blocks.PF


def _k4_scales_vec(e, wb, at):
    """simd._k4_scales' values from vector ops: one 16-byte load (the 12 scale bytes and 4 bytes after them: the caller
    guarantees they are readable, as qs follows scales in block_q4_K / block_q5_K) and a handful of xmm ops
    instead of ~17 scalar ones per block. The same integers, so the same results bit for bit."""
    bb = e.b
    v2 = V(I32, 2)
    u = e.load(wb, at, V(I32, 4))
    a = e.shuffle(u, u, [0, 1])  # u0, u1
    c = bb.lshr(e.shuffle(u, u, [2, 2]), ir.Constant(v2, [0, 4]))  # u2, u2 >> 4
    lo = bb.and_(a, e.const(I32, 2, 0x3F3F3F3F))
    hi = bb.or_(
        bb.and_(c, e.const(I32, 2, 0x0F0F0F0F)),
        bb.shl(bb.and_(bb.lshr(a, e.const(I32, 2, 6)), e.const(I32, 2, 0x03030303)), e.const(I32, 2, 4)),
    )
    sc = bb.bitcast(e.shuffle(lo, hi, [0, 2]), V(I8, 8))
    mn = bb.bitcast(e.shuffle(lo, hi, [1, 3]), V(I8, 8))
    return sc, mn


def _body(e, wb, xdb, dxb, xsb, b, blk, accs, scales_fn=_k4_scales, shl8=None, hi_nibbles=None):
    """simd_vnni._q4_k_vnni_body (copied) with three of its steps replaceable: the K-quant scale decode, the
    hi digits' << 8 and the high nibbles (None: the original instructions)."""
    # block_q4_K: d, dmin, scales[12], qs[128]; qs[32c + l] holds element l of sub-block 2c (low nibble) and
    # of sub-block 2c + 1 (high nibble)
    bb = e.b
    d, dmin = e.f16x2(wb, blk)
    scales, mins = scales_fn(e, wb, e.off(blk, 4))
    dx8 = e.load(dxb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    sdx = bb.fmul(bb.fmul(e.splat(d, 8), bb.uitofp(scales, V(F32, 8))), dx8)
    xb = bb.mul(b, ir.Constant(I64, SB_BYTES))
    zero = ir.Constant(V(I32, 16), [0] * 16)
    new = []
    for h in range(2):
        q = e.load(wb, e.off(blk, 16 + 64 * h), V(I8, 64))
        for n, wv in enumerate(
            (bb.and_(q, e.const(I8, 64, 15)), hi_nibbles(e, q) if hi_nibbles else bb.lshr(q, e.const(I8, 64, 4)))
        ):
            at = 256 * h + 128 * n
            xh = e.load(xdb, e.off(xb, at), V(I8, 64))
            xl = e.load(xdb, e.off(xb, at + 64), V(I8, 64))
            th = _dp_vnni(e, zero, wv, xh)
            th = shl8(e, th) if shl8 else bb.shl(th, ir.Constant(V(I32, 16), [8] * 16))
            t = _dp_vnni(e, th, wv, xl)
            # lane i: sub-block 2 * (2h + i // 8) + n
            scl = e.shuffle(sdx, sdx, [2 * (2 * h + i // 8) + n for i in range(16)])
            new.append(e.fma(accs[2 * h + n], bb.sitofp(t, V(F32, 16)), scl))
    xs8 = e.load(xsb, bb.mul(b, ir.Constant(I64, 32)), V(F32, 8), 4)
    mf = bb.uitofp(mins, V(F32, 8))
    new.append(e.fma(accs[4], bb.fmul(mf, xs8, flags=("fast",)), e.splat(dmin, 8)))
    return new


def _make(n_rows, interleaved):
    return _row_intrinsic(
        BB, _q4_k_vnni_body, 2, types.int8, 4, n_rows=n_rows, block_stride=n_rows * BB if interleaved else None
    )


dot2_f = _make(2, False)
dot4_f = _make(4, False)
dot2_i = _make(2, True)
dot4_i = _make(4, True)
dot8_i = _make(8, True)


def _shl8_pshufb(e, t):
    """t << 8 per int32 lane as a byte shuffle (vpshufb: port 5 on Intel, where vpslld competes with vpdpbusd and
    vcvtdq2ps for port 0). The control goes through an empty asm: LLVM would turn a constant shuffle back into
    the shift."""
    v64 = V(I8, 64)
    ctl = ir.Constant(v64, [(0x80 if j % 4 == 0 else (j % 16) - 1) for j in range(64)])
    ctl = e.opaque(ctl)
    mod = e.b.module
    name = "llvm.x86.avx512.pshuf.b.512"
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(v64, [v64, v64]), name=name)
    return e.b.bitcast(e.b.call(fn, [e.b.bitcast(t, v64), ctl]), V(I32, 16))


def _hi_nibbles_mshift(e, q):
    """q >> 4 per byte as vpmultishiftqb (bits 8j + 4 .. 8j + 11 of each qword: port 5) and a mask, where LLVM
    emits vgf2p8affineqb (port 0 for zmm on Intel)."""
    v64 = V(I8, 64)
    ctl = e.opaque(ir.Constant(V(I64, 8), [sum((8 * j + 4) << (8 * j) for j in range(8))] * 8))
    mod = e.b.module
    name = "llvm.x86.avx512.pmultishift.qb.512"
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(v64, [v64, v64]), name=name)
    return e.b.and_(e.b.call(fn, [e.b.bitcast(ctl, v64), q]), e.const(I8, 64, 15))


dot2_m = _row_intrinsic(
    BB, partial(_body, shl8=_shl8_pshufb, hi_nibbles=_hi_nibbles_mshift), 2, types.int8, 4, n_rows=2
)
dot2_s = _row_intrinsic(BB, partial(_body, shl8=_shl8_pshufb), 2, types.int8, 4, n_rows=2)
dot2_v = _row_intrinsic(BB, partial(_body, scales_fn=_k4_scales_vec), 2, types.int8, 4, n_rows=2)


def _kernel(dot, R, interleaved):
    """out[r] = row r . x for rows in groups of R (n_out a multiple of R)."""

    @numba.njit(parallel=True, fastmath=FASTMATH, error_model="numpy", nogil=True)
    def run(w, x, out, xq, aux, reps):
        dx, xs = blocks.prepare(blocks.Q4_K, x, xq, aux)
        n = out.size
        rb = w.size // n
        nb = x.size >> 8
        for _ in range(reps):
            for g in prange(n // R):
                if interleaved:
                    base, stride = g * R * rb, BB
                else:
                    base, stride = g * R * rb, rb
                res = dot(w, base, stride, xq, dx, xs, nb, PF)
                for r in range(R):
                    out[g * R + r] = res[r]

    return run


def _serial(dot, R, interleaved):
    """_kernel's loop on the calling thread (timed by its CPU time: a measure of compute that preemption by
    other processes does not inflate)."""

    @numba.njit(fastmath=FASTMATH, error_model="numpy", nogil=True)
    def run(w, x, out, xq, aux, reps):
        dx, xs = blocks.prepare(blocks.Q4_K, x, xq, aux)
        n = out.size
        rb = w.size // n
        nb = x.size >> 8
        for _ in range(reps):
            for g in range(n // R):
                base, stride = g * R * rb, (BB if interleaved else rb)
                res = dot(w, base, stride, xq, dx, xs, nb, PF)
                for r in range(R):
                    out[g * R + r] = res[r]

    return run


def _least(fn, rounds_time: float, clock) -> float:
    """Least time of repeated calls of fn by `clock` (at least 3, for rounds_time seconds), after one untimed call."""
    fn()
    best = float("inf")
    t_end = time.perf_counter() + rounds_time
    n = 0
    while n < 3 or time.perf_counter() < t_end:
        t = clock()
        fn()
        best = min(best, clock() - t)
        n += 1
    return best


def cpu_time(fn, rounds_time: float) -> float:
    """Least thread CPU time of repeated calls (fn runs on this thread)."""
    return _least(fn, rounds_time, time.thread_time)


VARIANTS = {
    "rows2": (2, False, dot2_f),
    "rows4": (4, False, dot4_f),
    "ilv2": (2, True, dot2_i),
    "ilv4": (4, True, dot4_i),
    "ilv8": (8, True, dot8_i),
    "rows2v": (2, False, dot2_v),  # rows2 with the K-quant scales decoded by vector ops (simd._k4_scales_vec)
    "rows2s": (2, False, dot2_s),  # rows2 with the hi digits' << 8 as vpshufb (port 5) instead of vpslld (port 0)
    "rows2m": (2, False, dot2_m),  # rows2s with the high nibbles by vpmultishiftqb (port 5), not vgf2p8affineqb
}


def interleave(w: np.ndarray, R: int) -> np.ndarray:
    """(n, rb) file rows -> the same bytes with super-block b of rows gR..gR+R-1 adjacent, flat uint8."""
    n, rb = w.shape
    nb = rb // BB
    return np.ascontiguousarray(w.reshape(n // R, R, nb, BB).transpose(0, 2, 1, 3)).reshape(-1)


def best_time(fn, rounds_time: float) -> float:
    """Least wall time of repeated calls."""
    return _least(fn, rounds_time, time.perf_counter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x768,768x2048,151936x2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--time", type=float, default=0.3, help="seconds per variant per round")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if not blocks.DIGITS:
        sys.exit("needs AVX512-VNNI (the digit path)")
    names = args.variants.split(",")
    kernels = {k: _kernel(VARIANTS[k][2], VARIANTS[k][0], VARIANTS[k][1]) for k in names}
    serial = {k: _serial(VARIANTS[k][2], VARIANTS[k][0], VARIANTS[k][1]) for k in names}
    rng = np.random.default_rng(0)
    print(f"# Q4_K decode row dot variants, best of {args.rounds} alternating rounds, numba {numba.__version__}")
    print(
        f"{'shape':>12} {'variant':>7} | {'L2 ns/(row,sb) 1thr':>19} | {'RAM GB/s 1thr':>13} {'2thr':>6} | max |diff|"
    )
    for shape in args.shapes.split(","):
        n_out, n_in = map(int, shape.split("x"))
        x = rng.standard_normal(n_in, dtype=np.float32)
        aux = np.empty(3 * (n_in // 32) + 1, np.float32)
        xq = blocks.act_buffer(n_in)
        w = make_weight(T.Q4_K, n_out, n_in, rng)[0]
        small = np.ascontiguousarray(w[:64])
        lay = {k: (interleave(w, VARIANTS[k][0]) if VARIANTS[k][1] else w.reshape(-1)) for k in names}
        lay_s = {k: (interleave(small, VARIANTS[k][0]) if VARIANTS[k][1] else small.reshape(-1)) for k in names}
        out = {k: np.empty(n_out, np.float32) for k in names}
        out_s = np.empty(64, np.float32)
        nsb = n_in // 256
        reps_l2 = max(1, int(2e6 // (64 * nsb)))
        res = {k: [float("inf")] * 3 for k in names}
        for _ in range(args.rounds):
            for k in names:
                f = kernels[k]
                t = cpu_time(partial(serial[k], lay_s[k], x, out_s, xq, aux, reps_l2), args.time / 3)
                res[k][0] = min(res[k][0], t / (reps_l2 * 64 * nsb) * 1e9)
                for j, th in ((1, 1), (2, 2)):
                    set_threads(th)
                    t = best_time(partial(f, lay[k], x, out[k], xq, aux, 1), args.time / 3)
                    res[k][j] = min(res[k][j], w.nbytes / t / 1e9)
        ref = out[names[0]]
        for k in names:
            diff = float(np.max(np.abs(out[k] - ref)))
            print(
                f"{shape:>12} {k:>7} | {res[k][0]:19.2f} | {res[k][1]:13.1f} {res[k][2]:6.1f} | {diff:.2e}", flush=True
            )


if __name__ == "__main__":
    main()
