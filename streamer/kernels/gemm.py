"""The f32 tile product shared by every prefill matmul.

Each quantized matmul dequantizes a tile of weight rows once into a small per-thread f32
scratch and then calls `gemm_tile`, so the dequantization cost is amortised over all m
activation rows. The register block is chosen for the host's vector registers, once, at import:
- 4x4 (16 accumulators, 8 vectors loaded per 16 FMAs) where there are 32 (AVX-512, and other targets);
- 4x3 (12 accumulators, 7 loads per 12 FMAs) on x86 without AVX-512, whose 16 ymm registers cannot hold the
  4x4 block's 24 live vectors (2026-12-03: the 4x4 block spilled and ran at 0.66x the 4x3 one).
Both compute every output as a vectorised f32 dot along K, but not to the same last bits (LLVM orders each
block's sums its own way); only one runs on a given CPU. The choice depends on the CPU alone, which is part of
numba's cache key, so a cached caller cannot hold the other.
"""

import numpy as np

from . import cpu
from ._bits import FASTMATH, kernel


@kernel(fastmath=FASTMATH, inline="always")
def _cols(t0, j, nr):
    """The T rows of columns j..j+3 (the 4x3 block uses the first three), each past the last column nr-1 replaced
    by it: every output of a tile comes from the register block, whatever its column, so a row's dot has the
    same bits at any position (a matrix cut in two, as qwen3next's ssm_in and attn_qkv + attn_gate, gives the
    rows of one the bits of the other's). The repeated row's products are computed and not stored."""
    last = t0 + nr - 1
    return min(t0 + j, last), min(t0 + j + 1, last), min(t0 + j + 2, last), min(t0 + j + 3, last)


@kernel(fastmath=FASTMATH, inline="always")
def _put4(out, i, c, s0, s1, s2, s3):
    """Rows i..i+3 of output column c."""
    out[i, c] = s0
    out[i + 1, c] = s1
    out[i + 2, c] = s2
    out[i + 3, c] = s3


@kernel(fastmath=FASTMATH, inline="always")
def _row_tail(X, T, t0, i, nr, out, c0):
    """Rows i.. (fewer than 4), every column."""
    m, K = X.shape
    while i < m:
        for j in range(nr):
            a = t0 + j
            s = np.float32(0)
            for k in range(K):
                s += X[i, k] * T[a, k]
            out[i, c0 + j] = s
        i += 1


@kernel(fastmath=FASTMATH)
def gemm_tile_4x4(X, T, t0, nr, out, c0):
    """out[i, c0 + j] = X[i] . T[t0 + j] for i < m, j < nr (T: f32 rows, X: f32 [m, K])."""
    m, K = X.shape
    i = 0
    while i + 4 <= m:
        j = 0
        while j < nr:  # a last block of fewer columns repeats the last row (see _cols)
            a0, a1, a2, a3 = _cols(t0, j, nr)
            s00 = s01 = s02 = s03 = np.float32(0)
            s10 = s11 = s12 = s13 = np.float32(0)
            s20 = s21 = s22 = s23 = np.float32(0)
            s30 = s31 = s32 = s33 = np.float32(0)
            for k in range(K):
                x0 = X[i, k]
                x1 = X[i + 1, k]
                x2 = X[i + 2, k]
                x3 = X[i + 3, k]
                w0 = T[a0, k]
                w1 = T[a1, k]
                w2 = T[a2, k]
                w3 = T[a3, k]
                s00 += x0 * w0
                s01 += x0 * w1
                s02 += x0 * w2
                s03 += x0 * w3
                s10 += x1 * w0
                s11 += x1 * w1
                s12 += x1 * w2
                s13 += x1 * w3
                s20 += x2 * w0
                s21 += x2 * w1
                s22 += x2 * w2
                s23 += x2 * w3
                s30 += x3 * w0
                s31 += x3 * w1
                s32 += x3 * w2
                s33 += x3 * w3
            _put4(out, i, c0 + j, s00, s10, s20, s30)
            if j + 1 < nr:
                _put4(out, i, c0 + j + 1, s01, s11, s21, s31)
            if j + 2 < nr:
                _put4(out, i, c0 + j + 2, s02, s12, s22, s32)
            if j + 3 < nr:
                _put4(out, i, c0 + j + 3, s03, s13, s23, s33)
            j += 4
        i += 4
    _row_tail(X, T, t0, i, nr, out, c0)


@kernel(fastmath=FASTMATH)
def gemm_tile_4x3(X, T, t0, nr, out, c0):
    """gemm_tile_4x4's product with a 4x3 register block (for 16 vector registers)."""
    m, K = X.shape
    i = 0
    while i + 4 <= m:
        j = 0
        while j < nr:  # a last block of fewer columns repeats the last row (see _cols)
            a0, a1, a2, _ = _cols(t0, j, nr)
            s00 = s01 = s02 = np.float32(0)
            s10 = s11 = s12 = np.float32(0)
            s20 = s21 = s22 = np.float32(0)
            s30 = s31 = s32 = np.float32(0)
            for k in range(K):
                w0 = T[a0, k]
                w1 = T[a1, k]
                w2 = T[a2, k]
                x0 = X[i, k]
                s00 += x0 * w0
                s01 += x0 * w1
                s02 += x0 * w2
                x1 = X[i + 1, k]
                s10 += x1 * w0
                s11 += x1 * w1
                s12 += x1 * w2
                x2 = X[i + 2, k]
                s20 += x2 * w0
                s21 += x2 * w1
                s22 += x2 * w2
                x3 = X[i + 3, k]
                s30 += x3 * w0
                s31 += x3 * w1
                s32 += x3 * w2
            _put4(out, i, c0 + j, s00, s10, s20, s30)
            if j + 1 < nr:
                _put4(out, i, c0 + j + 1, s01, s11, s21, s31)
            if j + 2 < nr:
                _put4(out, i, c0 + j + 2, s02, s12, s22, s32)
            j += 3
        i += 4
    _row_tail(X, T, t0, i, nr, out, c0)


_WIDE = cpu.vector_registers() == 32
gemm_tile = gemm_tile_4x4 if _WIDE else gemm_tile_4x3


# Rows of W dequantized per tile: TILE rows x K f32 stay in L2 while all m activation rows pass. A multiple of the
# register block's columns, so that a full tile has no partial block (2026-12-07: 15 rows 1.07-1.09x faster per
# FLOP than 16 with the 4x3 block).
TILE = 16 if _WIDE else 15
