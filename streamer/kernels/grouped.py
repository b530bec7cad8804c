"""Prefill MoE kernels: many experts, each with the few tokens routed to it, in two parallel calls.

A 32-token prefill chunk routes 256 (token, expert) pairs over 128 experts: two tokens per expert. One
matvec call per (matrix, token) pays a parallel launch and Python dispatch each time (hundreds per layer),
and a dequantized-tile matmul for two rows wastes its dequantization. Here the tokens are quantized once per
layer (`prepare_rows`), then one call covers the gate and up rows of a whole group of experts: each weight row
is read once and dotted with every token routed to that expert (`grouped_gate_up`); one more call computes the
down rows and adds each token's weighted expert outputs into its output row, in ascending expert order
(`grouped_down`). The row dots are blocks.dot on activations from blocks.prepare, exactly what the decode
kernels (experts.py) compute for one token, so a token's result equals the per-token path's bit for bit.
Experts with more tokens go through `grouped_matmul` (QMatrix.matmul's dequantized tiles, every expert of the
group in one call) and `scatter_add`.
"""

import numba
import numpy as np
from numba import prange

from ._bits import FASTMATH, fma32, kernel
from .blocks import deq, dot, dot2, dot2_tokens, prepare
from .gemm import gemm_tile
from .specialise import format_kernel


@format_kernel(parallel=True, fastmath=FASTMATH)
def prepare_rows(fmt, X, xq, aux):
    """Quantize each row of X (m, n_in) for the format's row dot: xq blocks.act_buffer(n_in, m), aux
    (m, 3 n_in/32 + 1) in blocks.prepare's layout (scales, then sums per 32, or per 16 for Q2_K)."""
    for t in prange(X.shape[0]):
        prepare(fmt, X[t], xq[t], aux[t])


@format_kernel(parallel=True, fastmath=FASTMATH)
def grouped_gate_up(fmt, w, offs, row_bytes, xq, aux, starts, toks, out):
    """For expert i of the group (gate at byte offs[0, i] of w, up at offs[1, i]) and each of its pairs p in
    starts[i]..starts[i+1] (token toks[p]): out[0, p] = gate . x, out[1, p] = up . x. out is (2, P, n_rows)."""
    n_in = (xq.shape[1] * xq.itemsize) >> 1  # xq: int16 (m, n_in) or int8 digits (m, 2 n_in)
    ng = n_in >> 5
    g = starts.size - 1
    n = out.shape[2]
    npair = (n + 1) >> 1  # rows in pairs (blocks.dot2), as experts_matvec: the same bits as the decode path
    for task in prange(g * 2 * npair):
        i = task // (2 * npair)
        r = task - i * 2 * npair
        part = r // npair
        rr = 2 * (r - part * npair)
        off = offs[part, i] + rr * row_bytes
        p, end = starts[i], starts[i + 1]
        while p < end:
            t = toks[p]
            if rr + 1 < n:
                k = dot2_tokens(fmt, w, off, row_bytes, xq, aux, toks, p, min(end - p, 3), out[part], rr)
                if k > 0:  # 2 or 3 tokens at once, each the bits of dot2's
                    p += k
                    continue
                out[part, p, rr], out[part, p, rr + 1] = dot2(
                    fmt, w, off, row_bytes, xq[t], aux[t, :ng], aux[t, ng : 3 * ng], n_in
                )
            else:
                out[part, p, rr] = dot(fmt, w, off, xq[t], aux[t, :ng], aux[t, ng : 3 * ng], n_in)
            p += 1


# Output row pairs per task of grouped_down: an expert's down matrix is read in runs this long (not tuned: 64 pairs
# of a 768-wide Q4_K matrix are 55 KB, and the 30B-A3B's 32-token prefill makes about 1,500 tasks for the threads)
DOWN_ROWS = 64


@format_kernel(parallel=True, fastmath=FASTMATH)
def grouped_down(fmt, w, offs, starts, row_bytes, a, aq, aux, weights, tstarts, perm, out):
    """out[t, r] += sum over pairs q in tstarts[t]..tstarts[t+1] (in that order), with p = perm[q], of
    weights[p] * (row r of pair p's expert's down matrix) . a[p], expert i's matrix at byte offs[i] of w and its
    pairs starts[i]..starts[i+1] (as grouped_gate_up's). a (P, n_in) f32; aq, aux scratch. First each expert's
    down matrix is read front to back, its rows dotted with its pairs 2 or 3 at a time (blocks.dot2_tokens: a row
    read once), into d (P, n_out); then each token's row sums its pairs' d in order."""
    P, n_in = a.shape
    ng = n_in >> 5
    for p in prange(P):
        prepare(fmt, a[p], aq[p], aux[p])
    g = starts.size - 1
    pairs = np.arange(P)
    n = out.shape[1]
    npair = (n + 1) >> 1
    runs = (npair + DOWN_ROWS - 1) // DOWN_ROWS
    d = np.empty((P, n), np.float32)
    for task in prange(g * runs):
        i = task // runs
        p0, p1 = starts[i], starts[i + 1]
        lo = (task - i * runs) * DOWN_ROWS
        for pr in range(lo, min(npair, lo + DOWN_ROWS)):  # output rows in pairs (blocks.dot2), as experts_down
            r = 2 * pr
            off = offs[i] + r * row_bytes
            p = p0
            while p < p1:
                if r + 1 < n:
                    k = dot2_tokens(fmt, w, off, row_bytes, aq, aux, pairs, p, min(p1 - p, 3), d, r)
                    if k == 0:
                        d[p, r], d[p, r + 1] = dot2(fmt, w, off, row_bytes, aq[p], aux[p, :ng], aux[p, ng : 3 * ng],
                                                    n_in)  # fmt: skip
                        k = 1
                    p += k
                else:
                    d[p, r] = dot(fmt, w, off, aq[p], aux[p, :ng], aux[p, ng : 3 * ng], n_in)
                    p += 1
    for r in prange(n):
        for t in range(tstarts.size - 1):
            acc = out[t, r]
            for q in range(tstarts[t], tstarts[t + 1]):
                p = perm[q]
                acc = fma32(weights[p], d[p, r], acc)  # as experts_down: one rounding
            out[t, r] = acc


@format_kernel(parallel=True, fastmath=FASTMATH)
def grouped_matmul(fmt, w, offs, row_bytes, X, starts, out, scratch):
    """For part j and expert i of the group (its rows at byte offs[j, i] of w) and its pairs starts[i]..
    starts[i+1] (rows of X): out[j, those] = X[those] @ W_ji^T. As QMatrix.matmul computes it (blocks'
    block_matmul: TILE rows dequantized exactly into a per-thread f32 scratch, then gemm_tile), for every
    expert of the group in one parallel call. out is (parts, P, n_rows); scratch (threads, TILE, n_in)."""
    parts, g = offs.shape
    n = out.shape[2]
    K = X.shape[1]
    tile = scratch.shape[1]  # gemm.TILE rows (blocks.block_matmul)
    nt = (n + tile - 1) // tile
    for task in prange(parts * g * nt):
        j = task // (g * nt)
        rest = task - j * g * nt
        i = rest // nt
        t = rest - i * nt
        a = starts[i]
        b = starts[i + 1]
        if b > a:
            buf = scratch[numba.get_thread_id()]
            r0 = t * tile
            nr = min(tile, n - r0)
            for q in range(nr):
                deq(fmt, w, offs[j, i] + (r0 + q) * row_bytes, buf, q * K, K)
            gemm_tile(X[a:b], buf, 0, nr, out[j, a:b], r0)


@kernel(parallel=True, fastmath=FASTMATH)
def scatter_add(out, y, weights, tstarts, perm):
    """out[t] += weights[p] * y[p] for p = perm[q], q in tstarts[t]..tstarts[t+1], in that order."""
    for t in prange(tstarts.size - 1):
        for q in range(tstarts[t], tstarts[t + 1]):
            p = perm[q]
            wp = weights[p]
            for r in range(out.shape[1]):
                out[t, r] += wp * y[p, r]
