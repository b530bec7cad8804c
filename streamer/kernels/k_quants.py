"""Q4_K, Q5_K and Q6_K weights: 256-element super-blocks with 6-bit (or int8) sub-block scales.

Mirrors ggml's block_q4_K {d, dmin, scales[12], qs[128]} (144 bytes), block_q5_K
{d, dmin, scales[12], qh[32], qs[128]} (176 bytes) and block_q6_K {ql[128], qh[64],
int8 scales[16], d} (210 bytes), as decoded by ggml's dequantize_row_q{4,5,6}_K.
Rows are read straight from the GGUF bytes: matvec runs simd's vector row dot on x quantized
to int16 per 256 (the mins use exact f32 sums of x); matmul and rows dequantize exactly.
"""
import numba
from numba import njit, prange

from ._bits import FASTMATH
from .activations import group_sums, quantize_groups
from .gemm import TILE, gemm_tile
from .simd import q4_k_deq, q4_k_dot, q5_k_deq, q5_k_dot, q6_k_deq, q6_k_dot

# Prefetch distance in bytes ahead of the super-block being read.
PF = 4096


@njit(cache=True, error_model="numpy", nogil=True, fastmath=FASTMATH)
def _prepare(x, xq, aux):
    """int16 x per 256 (dx = aux[:n/32], first n/256 used) and f32 sums per 32 (xs = aux[n/32:])."""
    ng = x.size >> 5
    dx = aux[:ng]
    xs = aux[ng:2 * ng]
    quantize_groups(x, xq, dx, 256)
    group_sums(x, xs)
    return dx, xs


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q4_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q4_k_dot(w, r * rb, xq, dx, xs, x.size >> 8, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q5_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q5_k_dot(w, r * rb, xq, dx, xs, x.size >> 8, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q6_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q6_k_dot(w, r * rb, xq, dx, xs, x.size >> 8, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q4_k_matmul(w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q4_k_deq(w, (r0 + j) * rb, buf, j * K, K >> 8)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q5_k_matmul(w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q5_k_deq(w, (r0 + j) * rb, buf, j * K, K >> 8)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q6_k_matmul(w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q6_k_deq(w, (r0 + j) * rb, buf, j * K, K >> 8)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, error_model="numpy", nogil=True)
def q4_k_rows(w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        q4_k_deq(w, ids[i] * w.shape[1], out, i * K, K >> 8)


@njit(cache=True, error_model="numpy", nogil=True)
def q5_k_rows(w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        q5_k_deq(w, ids[i] * w.shape[1], out, i * K, K >> 8)


@njit(cache=True, error_model="numpy", nogil=True)
def q6_k_rows(w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        q6_k_deq(w, ids[i] * w.shape[1], out, i * K, K >> 8)
