"""Q8_0 and Q4_0 weights: 32-element blocks with one f16 scale.

Mirrors ggml's block_q8_0 {ggml_half d; int8_t qs[32]} (34 bytes) and
block_q4_0 {ggml_half d; uint8_t qs[16]} (18 bytes; element l is the low nibble of qs[l],
element l+16 the high nibble, value d * (q - 8)). Rows are read straight from the GGUF bytes.
matvec runs simd's vector row dot on int16-quantized x; matmul and rows dequantize exactly.
"""
import numba
import numpy as np
from numba import njit, prange

from ._bits import FASTMATH, f16_to_f32
from .activations import quantize_groups
from .gemm import TILE, gemm_tile
from .simd import q4_0_dot, q8_0_dot


# ---- Q8_0 ------------------------------------------------------------------------------

# Prefetch distance in bytes ahead of the block being read: rows are read front to back.
PF = 1024


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q8_0_matvec(w, x, out, xq, aux):
    # x quantized to int16 per 32-block (activations.py); the row dot is simd.q8_0_dot.
    nb = x.size >> 5
    dx = aux[:nb]
    quantize_groups(x, xq, dx, 32)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q8_0_dot(w, r * rb, xq, dx, dx, nb, PF)


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

@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def q4_0_matvec(w, x, out, xq, aux):
    nb = x.size >> 5
    dx = aux[:nb]
    quantize_groups(x, xq, dx, 32)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q4_0_dot(w, r * rb, xq, dx, dx, nb, PF)


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
