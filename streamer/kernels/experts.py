"""Decode-time MoE kernels: all routed experts of a layer in one parallel call each for gate+up and for down.

A token's 8 experts are 24 small matrices (768x2048 at 30B-A3B); one call per matrix pays a parallel
launch and leaves threads idle at the tail each time. Here every expert's rows sit at a byte offset of one
base array (the file's mapping when experts are resident, the cache arena when they stream), and one
prange covers the rows of all of them. The row dots are blocks.dot's (same as QMatrix.matvec: x rounded to
int16 per 32 or 256 elements, or Q4_K's int8 digits: per 32 with VNNI, per 256 on AVX2), so results match the
per-matrix path up to float32 rounding.

Near the end of one matrix, experts_matvec's row dots prefetch the next matrix's first rows instead of the
bytes past the end (blocks.dot2_pf): a thread would otherwise meet each matrix's first 8 KiB as cache misses,
16 times a step per layer.

`experts_down` adds each expert's weighted contribution into `out` in expert order, starting from out's
current value: the additions happen in the same sequence however the experts are grouped.
"""

import numpy as np
from numba import prange

from ..formats import BLOCK_CODES as FORMATS
from ._bits import FASTMATH, fma32
from .blocks import PF, act_buffer, dot, dot2, dot2_pf, prepare
from .specialise import format_kernel

__all__ = ["FORMATS", "ExpertScratch", "experts_down", "experts_matvec"]


@format_kernel(parallel=True, fastmath=FASTMATH)
def experts_matvec(fmt, w, offs, row_bytes, x, out, xq, aux):
    """out[i, r] = row r of the matrix starting at byte offs[i] of w, dot x. out is (n_mats, n_rows)."""
    dx, xs = prepare(fmt, x, xq, aux)
    k, n = out.shape
    npair = (n + 1) >> 1  # each matrix's rows in pairs (blocks.dot2), its last alone if n is odd
    size = n * row_bytes
    for t in prange(k * npair):
        i = t // npair
        r = 2 * (t - i * npair)
        at = offs[i] + r * row_bytes
        pf = PF
        if i + 1 < k and r * row_bytes + PF >= size:  # near the matrix's end: prefetch the next one's start
            pf = PF + offs[i + 1] - offs[i] - size
        if r + 1 < n:
            out[i, r], out[i, r + 1] = dot2_pf(fmt, w, at, row_bytes, xq, dx, xs, x.size, pf)
        else:
            out[i, r] = dot(fmt, w, at, xq, dx, xs, x.size)


@format_kernel(parallel=True, fastmath=FASTMATH)
def experts_down(fmt, w, offs, row_bytes, a, weights, out, xq, aux):
    """out[r] += sum over i, in order, of weights[i] * (row r of matrix i) . a[i]; a is (n_mats, n_in)."""
    k, n_in = a.shape
    ng = n_in >> 5
    for i in range(k):
        prepare(fmt, a[i], xq[i], aux[i])
    n = out.size
    for p in prange((n + 1) >> 1):  # output rows in pairs (blocks.dot2), the last alone if n is odd
        r = 2 * p
        if r + 1 < n:
            acc0, acc1 = out[r], out[r + 1]
            for i in range(k):
                d0, d1 = dot2(fmt, w, offs[i] + r * row_bytes, row_bytes, xq[i], aux[i, :ng], aux[i, ng : 3 * ng], n_in)
                acc0 = fma32(weights[i], d0, acc0)  # one rounding, whatever LLVM makes of the code around it
                acc1 = fma32(weights[i], d1, acc1)
            out[r], out[r + 1] = acc0, acc1
        else:
            acc = out[r]
            for i in range(k):
                d = dot(fmt, w, offs[i] + r * row_bytes, xq[i], aux[i, :ng], aux[i, ng : 3 * ng], n_in)
                acc = fma32(weights[i], d, acc)
            out[r] = acc


class ExpertScratch:
    """Activation-quantization buffers for up to k experts of n_in inputs, allocated once."""

    def __init__(self, k: int, n_in: int):
        self.xq = act_buffer(n_in, k)  # int16, or int8 digits where the CPU has VNNI (blocks.prepare)
        self.aux = np.empty((k, 3 * (n_in >> 5) + 1), np.float32)  # blocks.prepare's layout
