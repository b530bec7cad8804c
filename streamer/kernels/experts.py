"""Decode-time MoE kernels: all routed experts of a layer in one parallel call each for gate+up and for down.

A token's 8 experts are 24 small matrices (768x2048 at 30B-A3B); one call per matrix pays a parallel
launch and leaves threads idle at the tail each time. Here every expert's rows sit at a byte offset of one
base array (the file's mapping when experts are resident, the cache arena when they stream), and one
prange covers the rows of all of them. The row dots are simd's (same as QMatrix.matvec: x rounded to
int16 per 32 or 256 elements), so results match the per-matrix path up to float32 rounding.

`experts_down` adds each expert's weighted contribution into `out` in expert order, starting from out's
current value: the additions happen in the same sequence however the experts are grouped.
"""
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from ._bits import FASTMATH
from .activations import group_sums, quantize_groups
from .simd import q4_0_dot, q4_k_dot, q5_k_dot, q6_k_dot, q8_0_dot

PF = 4096  # prefetch distance in bytes, as in the per-format matvecs
# formats with a row dot, by a small code the kernels branch on (once per row: predictable)
FORMATS = {T.Q8_0: 0, T.Q4_0: 1, T.Q4_K: 2, T.Q5_K: 3, T.Q6_K: 4}


@njit(cache=True, error_model="numpy", nogil=True, fastmath=FASTMATH, inline="always")
def _prepare(fmt, x, xq, aux):
    """Quantize x as that format's matvec does; return (dx, xs) views of aux."""
    ng = x.size >> 5
    if fmt >= 2:
        quantize_groups(x, xq, aux[:ng], 256)
        group_sums(x, aux[ng:2 * ng])
    else:
        quantize_groups(x, xq, aux[:ng], 32)
    return aux[:ng], aux[ng:2 * ng]


@njit(cache=True, error_model="numpy", nogil=True, fastmath=FASTMATH, inline="always")
def _dot(fmt, w, off, xq, dx, xs, n_in):
    if fmt == 2:
        return q4_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == 4:
        return q6_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == 3:
        return q5_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == 0:
        return q8_0_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    return q4_0_dot(w, off, xq, dx, dx, n_in >> 5, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def experts_matvec(fmt, w, offs, row_bytes, x, out, xq, aux):
    """out[i, r] = row r of the matrix starting at byte offs[i] of w, dot x. out is (n_mats, n_rows)."""
    dx, xs = _prepare(fmt, x, xq, aux)
    k, n = out.shape
    for t in prange(k * n):
        i = t // n
        r = t - i * n
        out[i, r] = _dot(fmt, w, offs[i] + r * row_bytes, xq, dx, xs, x.size)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def experts_down(fmt, w, offs, row_bytes, a, weights, out, xq, aux):
    """out[r] += sum over i, in order, of weights[i] * (row r of matrix i) . a[i]; a is (n_mats, n_in)."""
    k, n_in = a.shape
    ng = n_in >> 5
    for i in range(k):
        _prepare(fmt, a[i], xq[i], aux[i])
    for r in prange(out.size):
        acc = out[r]
        for i in range(k):
            acc += weights[i] * _dot(fmt, w, offs[i] + r * row_bytes, xq[i], aux[i, :ng], aux[i, ng:2 * ng], n_in)
        out[r] = acc


class ExpertScratch:
    """Activation-quantization buffers for up to k experts of n_in inputs, allocated once."""

    def __init__(self, k: int, n_in: int):
        self.xq = np.empty((k, n_in), np.int16)
        self.aux = np.empty((k, 2 * (n_in >> 5) + 1), np.float32)
