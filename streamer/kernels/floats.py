"""F32, F16 and BF16 weights (ggml types 0, 1, 30): plain row-major element arrays.

F16 and BF16 arrive as uint16 bit patterns (numba has no CPU float16); they are widened
in registers, never copied, by one set of kernels that takes a format code. matvec does 4 rows
per iteration so each x load feeds 4 FMAs. Every kernel takes a format code first (the F32 ones
ignore it), the calling convention dispatch.py uses for all formats.
"""

import numba
import numpy as np
from numba import prange

from ._bits import FASTMATH, bf16_to_f32, copy_row, f16_to_f32, kernel
from .gemm import gemm_tile
from .specialise import format_kernel

# ---- F32 -------------------------------------------------------------------------------


@format_kernel(every=True, parallel=True, fastmath=FASTMATH)
def f32_matvec(fmt, w, x, out, xq, aux):
    n_out, n = w.shape
    for g in prange((n_out + 3) >> 2):
        r = g << 2
        if r + 4 <= n_out:
            s0 = s1 = s2 = s3 = np.float32(0)
            for k in range(n):
                xv = x[k]
                s0 += w[r, k] * xv
                s1 += w[r + 1, k] * xv
                s2 += w[r + 2, k] * xv
                s3 += w[r + 3, k] * xv
            out[r] = s0
            out[r + 1] = s1
            out[r + 2] = s2
            out[r + 3] = s3
        else:
            for rr in range(r, n_out):
                s = np.float32(0)
                for k in range(n):
                    s += w[rr, k] * x[k]
                out[rr] = s


@format_kernel(every=True, parallel=True, fastmath=FASTMATH)
def f32_matmul(fmt, w, X, out, scratch):
    # No dequantization needed: the tile product reads W's rows in place.
    n_out = w.shape[0]
    tile = scratch.shape[1]  # gemm.TILE rows (blocks.block_matmul)
    for t in prange((n_out + tile - 1) // tile):
        r0 = t * tile
        gemm_tile(X, w, r0, min(tile, n_out - r0), out, r0)


@format_kernel(every=True)
def f32_rows(fmt, w, ids, out):
    for i in range(ids.size):
        copy_row(w, ids[i], out, i)


# ---- F16 and BF16: one set of kernels, `bf` (formats.F16 or BF16) picks the widening ----------


@kernel(inline="always")
def _widen(bf, v):
    return bf16_to_f32(v) if bf else f16_to_f32(v)


@format_kernel("bf", every=True, parallel=True, fastmath=FASTMATH)
def half_matvec(bf, w, x, out, xq, aux):
    n_out, n = w.shape
    for g in prange((n_out + 3) >> 2):
        r = g << 2
        if r + 4 <= n_out:
            s0 = s1 = s2 = s3 = np.float32(0)
            for k in range(n):
                xv = x[k]
                s0 += _widen(bf, w[r, k]) * xv
                s1 += _widen(bf, w[r + 1, k]) * xv
                s2 += _widen(bf, w[r + 2, k]) * xv
                s3 += _widen(bf, w[r + 3, k]) * xv
            out[r] = s0
            out[r + 1] = s1
            out[r + 2] = s2
            out[r + 3] = s3
        else:
            for rr in range(r, n_out):
                s = np.float32(0)
                for k in range(n):
                    s += _widen(bf, w[rr, k]) * x[k]
                out[rr] = s


@kernel()
def half_row(bf, w, r, dst, j):
    for k in range(w.shape[1]):
        dst[j, k] = _widen(bf, w[r, k])


@format_kernel("bf", every=True, parallel=True, fastmath=FASTMATH)
def half_matmul(bf, w, X, out, scratch):
    n_out = w.shape[0]
    tile = scratch.shape[1]  # gemm.TILE rows (blocks.block_matmul)
    for t in prange((n_out + tile - 1) // tile):
        buf = scratch[numba.get_thread_id()]
        r0 = t * tile
        nr = min(tile, n_out - r0)
        for j in range(nr):
            half_row(bf, w, r0 + j, buf, j)
        gemm_tile(X, buf, 0, nr, out, r0)


@format_kernel("bf", every=True)
def half_rows(bf, w, ids, out):
    for i in range(ids.size):
        half_row(bf, w, ids[i], out, i)
