"""Q4_K, Q5_K and Q6_K weights: 256-element super-blocks with 6-bit (or int8) sub-block scales.

Mirrors ggml's block_q4_K {d, dmin, scales[12], qs[128]} (144 bytes), block_q5_K
{d, dmin, scales[12], qh[32], qs[128]} (176 bytes) and block_q6_K {ql[128], qh[64],
int8 scales[16], d} (210 bytes), as decoded by ggml's dequantize_row_q{4,5,6}_K.
Rows are read straight from the GGUF bytes. matvec runs simd's vector row dot on x quantized
to int16 per 256 (mins use exact f32 sums of x); matmul and rows dequantize exactly.
"""
import numba
import numpy as np
from numba import njit, prange

from ._bits import FASTMATH, f16_to_f32
from .activations import group_sums, quantize_groups
from .gemm import TILE, gemm_tile
from .simd import q4_k_dot, q5_k_dot, q6_k_dot


@njit(cache=True, nogil=True, inline="always")
def _f16(w, r, o):
    return f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8))


@njit(cache=True, nogil=True, inline="always")
def scale_min_k4(w, r, s, j):
    """ggml get_scale_min_k4: the 6-bit scale and min of sub-block j from scales[12] at byte s."""
    if j < 4:
        return np.int32(w[r, s + j] & 63), np.int32(w[r, s + j + 4] & 63)
    sc = (w[r, s + j + 4] & 15) | ((w[r, s + j - 4] >> 6) << 4)
    mn = (w[r, s + j + 4] >> 4) | ((w[r, s + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


# Prefetch distance in bytes ahead of the super-block being read.
PF = 1024


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _prepare(x, xq, aux):
    """int16 x per 256 (dx = aux[:n/256]) and f32 sums per 32 for the mins (xs = aux[n/32:])."""
    ng = x.size >> 5
    dx = aux[:ng]
    xs = aux[ng:2 * ng]
    quantize_groups(x, xq, dx, 256)
    group_sums(x, xs)
    return dx, xs


# ---- Q4_K ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q4_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    nb = x.size >> 8
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q4_k_dot(w, r * rb, xq, dx, xs, nb, PF)


@njit(cache=True, nogil=True)
def q4_k_row(w, r, dst, j):
    for b in range(dst.shape[1] >> 8):
        o = b * 144
        d = _f16(w, r, o)
        dmin = _f16(w, r, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(w, r, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(w, r, o + 4, 2 * c + 1)
            d1 = d * np.float32(sc1)
            d2 = d * np.float32(sc2)
            mf1 = dmin * np.float32(m1)
            mf2 = dmin * np.float32(m2)
            q0 = o + 16 + c * 32
            xb = (b << 8) + c * 64
            for l in range(32):
                v = w[r, q0 + l]
                dst[j, xb + l] = d1 * np.float32(v & 15) - mf1
                dst[j, xb + 32 + l] = d2 * np.float32(v >> 4) - mf2


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q4_k_matmul(w, X, out, scratch):
    n_out = w.shape[0]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q4_k_row(w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, nogil=True)
def q4_k_rows(w, ids, out):
    for i in range(ids.size):
        q4_k_row(w, ids[i], out, i)


# ---- Q5_K ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q5_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    nb = x.size >> 8
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q5_k_dot(w, r * rb, xq, dx, xs, nb, PF)


@njit(cache=True, nogil=True)
def q5_k_row(w, r, dst, j):
    for b in range(dst.shape[1] >> 8):
        o = b * 176
        d = _f16(w, r, o)
        dmin = _f16(w, r, o + 2)
        for c in range(4):
            sc1, m1 = scale_min_k4(w, r, o + 4, 2 * c)
            sc2, m2 = scale_min_k4(w, r, o + 4, 2 * c + 1)
            d1 = d * np.float32(sc1)
            d2 = d * np.float32(sc2)
            mf1 = dmin * np.float32(m1)
            mf2 = dmin * np.float32(m2)
            q0 = o + 48 + c * 32
            xb = (b << 8) + c * 64
            for l in range(32):
                v = w[r, q0 + l]
                h = w[r, o + 16 + l] >> (2 * c)
                dst[j, xb + l] = d1 * np.float32((v & 15) | ((h & 1) << 4)) - mf1
                dst[j, xb + 32 + l] = d2 * np.float32((v >> 4) | ((h & 2) << 3)) - mf2


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q5_k_matmul(w, X, out, scratch):
    n_out = w.shape[0]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q5_k_row(w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, nogil=True)
def q5_k_rows(w, ids, out):
    for i in range(ids.size):
        q5_k_row(w, ids[i], out, i)


# ---- Q6_K ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q6_k_matvec(w, x, out, xq, aux):
    dx, xs = _prepare(x, xq, aux)
    nb = x.size >> 8
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q6_k_dot(w, r * rb, xq, dx, xs, nb, PF)


@njit(cache=True, nogil=True)
def q6_k_row(w, r, dst, j):
    wi = w.view(np.int8)
    for b in range(dst.shape[1] >> 8):
        o = b * 210
        d = _f16(w, r, o + 208)
        for h in range(2):
            ql = o + h * 64
            qh = o + 128 + h * 32
            sc = o + 192 + h * 8
            xb = (b << 8) + h * 128
            for l in range(32):
                i = l >> 4
                a = w[r, ql + l]
                c = w[r, ql + 32 + l]
                q = w[r, qh + l]
                dst[j, xb + l] = (d * np.float32(wi[r, sc + i])) * np.float32(np.int32((a & 15) | ((q & 3) << 4)) - 32)
                dst[j, xb + 32 + l] = (d * np.float32(wi[r, sc + 2 + i])) * np.float32(np.int32((c & 15) | (((q >> 2) & 3) << 4)) - 32)
                dst[j, xb + 64 + l] = (d * np.float32(wi[r, sc + 4 + i])) * np.float32(np.int32((a >> 4) | (((q >> 4) & 3) << 4)) - 32)
                dst[j, xb + 96 + l] = (d * np.float32(wi[r, sc + 6 + i])) * np.float32(np.int32((c >> 4) | (((q >> 6) & 3) << 4)) - 32)


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q6_k_matmul(w, X, out, scratch):
    n_out = w.shape[0]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q6_k_row(w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, nogil=True)
def q6_k_rows(w, ids, out):
    for i in range(ids.size):
        q6_k_row(w, ids[i], out, i)
