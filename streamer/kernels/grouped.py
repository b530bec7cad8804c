"""Prefill MoE kernels: many experts, each with the few tokens routed to it, in two parallel calls.

A 32-token prefill chunk routes 256 (token, expert) pairs over 128 experts: two tokens per expert. One
matvec call per (matrix, token) pays a parallel launch and Python dispatch each time (hundreds per layer),
and a dequantized-tile matmul for two rows wastes its dequantization. Here the tokens are quantized once per
layer (`prepare_rows`), then one call covers the gate and up rows of a whole group of experts: each weight row
is read once and dotted with every token routed to that expert (`grouped_gate_up`); one more call computes the
down rows and adds each token's weighted expert outputs into its output row, in ascending expert order
(`grouped_down`). The row dots are blocks.dot on activations from blocks.prepare, exactly what the decode
kernels (experts.py) compute for one token, so a token's result equals the per-token path's bit for bit.
"""

from numba import prange

from ._bits import FASTMATH, kernel
from .blocks import dot, prepare


@kernel(parallel=True, fastmath=FASTMATH)
def prepare_rows(fmt, X, xq, aux):
    """Quantize each row of X (m, n_in) for the format's row dot: xq (m, n_in) int16, aux (m, 2 n_in/32 + 1)."""
    for t in prange(X.shape[0]):
        prepare(fmt, X[t], xq[t], aux[t])


@kernel(parallel=True, fastmath=FASTMATH)
def grouped_gate_up(fmt, w, offs, row_bytes, xq, aux, starts, toks, out):
    """For expert i of the group (gate at byte offs[0, i] of w, up at offs[1, i]) and each of its pairs p in
    starts[i]..starts[i+1] (token toks[p]): out[0, p] = gate . x, out[1, p] = up . x. out is (2, P, n_rows)."""
    n_in = xq.shape[1]
    ng = n_in >> 5
    g = starts.size - 1
    n = out.shape[2]
    for task in prange(g * 2 * n):
        i = task // (2 * n)
        r = task - i * 2 * n
        part = r // n
        rr = r - part * n
        off = offs[part, i] + rr * row_bytes
        for p in range(starts[i], starts[i + 1]):
            t = toks[p]
            out[part, p, rr] = dot(fmt, w, off, xq[t], aux[t, :ng], aux[t, ng : 2 * ng], n_in)


@kernel(parallel=True, fastmath=FASTMATH)
def grouped_down(fmt, w, poffs, row_bytes, a, aq, aux, weights, tstarts, perm, out):
    """out[t, r] += sum over pairs q in tstarts[t]..tstarts[t+1] (in that order), with p = perm[q], of
    weights[p] * (row r of the down matrix at byte poffs[p] of w) . a[p]. a (P, n_in) f32; aq, aux scratch."""
    P, n_in = a.shape
    ng = n_in >> 5
    for p in prange(P):
        prepare(fmt, a[p], aq[p], aux[p])
    m = tstarts.size - 1
    for r in prange(out.shape[1]):
        for t in range(m):
            acc = out[t, r]
            for q in range(tstarts[t], tstarts[t + 1]):
                p = perm[q]
                acc += weights[p] * dot(fmt, w, poffs[p] + r * row_bytes, aq[p], aux[p, :ng], aux[p, ng : 2 * ng], n_in)
            out[t, r] = acc
