"""Q8_0 and Q4_0 weights: 32-element blocks with one f16 scale.

Mirrors ggml's block_q8_0 {ggml_half d; int8_t qs[32]} (34 bytes) and
block_q4_0 {ggml_half d; uint8_t qs[16]} (18 bytes; element l is the low nibble of qs[l],
element l+16 the high nibble, value d * (q - 8)). Rows are read straight from the GGUF bytes.
"""
import numba
import numpy as np
from numba import njit, prange

from ._bits import FASTMATH, f16_to_f32
from .gemm import TILE, gemm_tile


# ---- Q8_0 ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=FASTMATH)
def q8_0_dot(w, wi, r, x):
    """One row of block_q8_0 against f32 x."""
    acc = np.float32(0)
    for b in range(x.size >> 5):
        o = b * 34
        s = np.float32(0)
        for k in range(32):
            s += np.float32(wi[r, o + 2 + k]) * x[(b << 5) + k]
        acc += f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8)) * s
    return acc


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q8_0_matvec(w, x, out, xs):
    n_out = w.shape[0]
    wi = w.view(np.int8)
    for g in prange((n_out + 3) >> 2):
        r = g << 2
        if r + 4 <= n_out:
            a0 = a1 = a2 = a3 = np.float32(0)
            for b in range(x.size >> 5):
                o = b * 34
                xb = b << 5
                s0 = s1 = s2 = s3 = np.float32(0)
                for k in range(32):
                    xv = x[xb + k]
                    s0 += np.float32(wi[r, o + 2 + k]) * xv
                    s1 += np.float32(wi[r + 1, o + 2 + k]) * xv
                    s2 += np.float32(wi[r + 2, o + 2 + k]) * xv
                    s3 += np.float32(wi[r + 3, o + 2 + k]) * xv
                a0 += f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8)) * s0
                a1 += f16_to_f32(w[r + 1, o] | (np.uint16(w[r + 1, o + 1]) << 8)) * s1
                a2 += f16_to_f32(w[r + 2, o] | (np.uint16(w[r + 2, o + 1]) << 8)) * s2
                a3 += f16_to_f32(w[r + 3, o] | (np.uint16(w[r + 3, o + 1]) << 8)) * s3
            out[r] = a0
            out[r + 1] = a1
            out[r + 2] = a2
            out[r + 3] = a3
        else:
            for rr in range(r, n_out):
                out[rr] = q8_0_dot(w, wi, rr, x)


@njit(cache=True, nogil=True)
def q8_0_row(w, r, dst, j):
    wi = w.view(np.int8)
    for b in range(dst.shape[1] >> 5):
        o = b * 34
        d = f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8))
        for k in range(32):
            dst[j, (b << 5) + k] = d * np.float32(wi[r, o + 2 + k])


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q8_0_matmul(w, X, out, scratch):
    n_out = w.shape[0]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q8_0_row(w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, nogil=True)
def q8_0_rows(w, ids, out):
    for i in range(ids.size):
        q8_0_row(w, ids[i], out, i)


# ---- Q4_0 ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=FASTMATH)
def q4_0_dot(w, r, x):
    """One row of block_q4_0 against f32 x."""
    acc = np.float32(0)
    for b in range(x.size >> 5):
        o = b * 18
        xb = b << 5
        s = np.float32(0)
        for l in range(16):
            v = w[r, o + 2 + l]
            s += np.float32(np.int32(v & 15) - 8) * x[xb + l]
            s += np.float32(np.int32(v >> 4) - 8) * x[xb + 16 + l]
        acc += f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8)) * s
    return acc


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q4_0_matvec(w, x, out, xs):
    n_out = w.shape[0]
    for r in prange(n_out):
        out[r] = q4_0_dot(w, r, x)


@njit(cache=True, nogil=True)
def q4_0_row(w, r, dst, j):
    for b in range(dst.shape[1] >> 5):
        o = b * 18
        xb = b << 5
        d = f16_to_f32(w[r, o] | (np.uint16(w[r, o + 1]) << 8))
        for l in range(16):
            v = w[r, o + 2 + l]
            dst[j, xb + l] = d * np.float32(np.int32(v & 15) - 8)
            dst[j, xb + 16 + l] = d * np.float32(np.int32(v >> 4) - 8)


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q4_0_matmul(w, X, out, scratch):
    n_out = w.shape[0]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q4_0_row(w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, nogil=True)
def q4_0_rows(w, ids, out):
    for i in range(ids.size):
        q4_0_row(w, ids[i], out, i)
