"""Q8_0 and Q4_0 weights: 32-element blocks with one f16 scale.

Mirrors ggml's block_q8_0 {ggml_half d; int8_t qs[32]} (34 bytes) and
block_q4_0 {ggml_half d; uint8_t qs[16]} (18 bytes; element l is the low nibble of qs[l],
element l+16 the high nibble, value d * (q - 8)). Rows are read straight from the GGUF bytes:
matvec runs simd's vector row dot on x quantized to int16 per 32; matmul and rows dequantize
exactly (simd's *_deq) into f32.
"""
import numba
from numba import njit, prange

from ._bits import FASTMATH
from .activations import quantize_groups
from .gemm import TILE, gemm_tile
from .simd import q4_0_deq, q4_0_dot, q8_0_deq, q8_0_dot

# Prefetch distance in bytes ahead of the block being read: rows are read front to back.
PF = 4096


# ---- Q8_0 ------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q8_0_matvec(w, x, out, xq, aux):
    nb = x.size >> 5
    dx = aux[:nb]
    quantize_groups(x, xq, dx, 32)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q8_0_dot(w, r * rb, xq, dx, dx, nb, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q8_0_matmul(w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q8_0_deq(w, (r0 + j) * rb, buf, j * K, K >> 5)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, error_model="numpy", nogil=True)
def q8_0_rows(w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        q8_0_deq(w, ids[i] * w.shape[1], out, i * K, K >> 5)


# ---- Q4_0 ------------------------------------------------------------------------------

@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q4_0_matvec(w, x, out, xq, aux):
    nb = x.size >> 5
    dx = aux[:nb]
    quantize_groups(x, xq, dx, 32)
    rb = w.shape[1]
    for r in prange(w.shape[0]):
        out[r] = q4_0_dot(w, r * rb, xq, dx, dx, nb, PF)


@njit(cache=True, error_model="numpy", nogil=True, parallel=True, fastmath=FASTMATH)
def q4_0_matmul(w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    for t in prange((n_out + TILE - 1) // TILE):
        buf = scratch[numba.get_thread_id()]
        r0 = t * TILE
        nr = min(TILE, n_out - r0)
        for j in range(nr):
            q4_0_deq(w, (r0 + j) * rb, buf, j * K, K >> 5)
        gemm_tile(X, buf, 0, nr, out, r0)


@njit(cache=True, error_model="numpy", nogil=True)
def q4_0_rows(w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        q4_0_deq(w, ids[i] * w.shape[1], out, i * K, K >> 5)
