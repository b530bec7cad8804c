"""Small numba kernels of the forward pass that are not matrix products: RMSNorm, per-head norm + NEOX RoPE
(RoPE alone for Qwen2),
causal grouped-query attention over the KV cache, SwiGLU. Flat functions over arrays, float32 in and out,
sums of squares in float64 as ggml does."""

from __future__ import annotations

import numpy as np
from numba import prange

from ._bits import f16_to_f32, f32_to_f16_bits, fma32, i32_as_f32, kernel
from .simd_attn import pv1x1, pv1x4, pv2x1, pv2x4, pv4x1, pv4x4, qk1, qk2, qk4


@kernel(fastmath=True, inline="always")
def exp32(x):
    """e**x in float32 without a libm call, so that loops over it vectorise (numba has no vector exp without
    Intel's SVML): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, ln2 in two parts, by llvm.fma so that fast-math
    cannot merge them), e**r by Cephes' expf polynomial, times 2**n from the exponent bits. x is clamped to
    [-87, 88] (a normal float32 result). Relative error <= 8.3e-8 there, under float32's epsilon (float64 oracle,
    tests/test_kernels.py); swiglu in place runs about 5x faster than with np.exp (1024 x 768: 0.44 ms, was 2.4)."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = fma32(n, np.float32(-0.693359375), x)
    r = fma32(n, np.float32(2.12194440e-4), r)
    p = np.float32(1.9875691500e-4)
    p = fma32(p, r, np.float32(1.3981999507e-3))
    p = fma32(p, r, np.float32(8.3334519073e-3))
    p = fma32(p, r, np.float32(4.1665795894e-2))
    p = fma32(p, r, np.float32(1.6666665459e-1))
    p = fma32(p, r, np.float32(5.0000001201e-1))
    y = fma32(p, r * r, r) + np.float32(1.0)
    return y * i32_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@kernel(fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, row by row; x and out are (m, n)."""
    m, n = x.shape
    for i in range(m):
        ss = 0.0
        for j in range(n):
            ss += np.float64(x[i, j]) * x[i, j]
        r = np.float32(1.0 / np.sqrt(ss / n + eps))
        for j in range(n):
            out[i, j] = x[i, j] * r * w[j]
    return out


@kernel(fastmath=True)
def head_norm_rope(x, w, eps, cos, sin, pos0):
    """In place on x (m, n_head, head_dim): RMSNorm each head with w, then NEOX RoPE at position pos0 + i on
    the first 2 * cos.shape[1] channels (all of them, or qwen35moe's partial rotation): channel j pairs with
    j + cos.shape[1] (the "half" layout of Qwen3; ggml's GGML_ROPE_TYPE_NEOX)."""
    m, nh, hd = x.shape
    half = cos.shape[1]
    for i in range(m):
        p = pos0 + i
        for h in range(nh):
            ss = 0.0
            for j in range(hd):
                ss += np.float64(x[i, h, j]) * x[i, h, j]
            r = np.float32(1.0 / np.sqrt(ss / hd + eps))
            for j in range(2 * half, hd):
                x[i, h, j] = x[i, h, j] * r * w[j]
            for j in range(half):
                a = x[i, h, j] * r * w[j]
                b = x[i, h, j + half] * r * w[j + half]
                c = cos[p, j]
                s = sin[p, j]
                x[i, h, j] = a * c - b * s
                x[i, h, j + half] = a * s + b * c
    return x


@kernel(fastmath=True)
def head_rope(x, cos, sin, pos0):
    """In place on x (m, n_head, head_dim): NEOX RoPE at position pos0 + i on the first 2 * cos.shape[1]
    channels, no norm (Qwen2)."""
    m, nh, hd = x.shape
    half = cos.shape[1]
    for i in range(m):
        p = pos0 + i
        for h in range(nh):
            for j in range(half):
                a = x[i, h, j]
                b = x[i, h, j + half]
                c = cos[p, j]
                s = sin[p, j]
                x[i, h, j] = a * c - b * s
                x[i, h, j + half] = a * s + b * c
    return x


def rope_tables(n_ctx: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of pos * theta^(-2j/head_dim) for every position, (n_ctx, head_dim/2) float32 (head_dim: the
    channels rotated)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@kernel(fastmath=True, inline="always")
def _score(q, i, h, kc, g, j):
    """q[i, h] . kc[g, j] (float16 bits widened) in a plain loop: the attention's scores where no block of
    simd_attn.py serves."""
    acc = np.float32(0.0)
    for d in range(q.shape[2]):
        acc += q[i, h, d] * f16_to_f32(kc[g, j, d])
    return acc


@kernel(fastmath=True, inline="always")
def _scores(H, q, qo, kc, ko, s, j, n, hd, scale):
    if H == 4:
        qk4(q, qo, kc, ko, s, j, n, hd, scale)
    elif H == 2:
        qk2(q, qo, kc, ko, s, j, n, hd, scale)
    else:
        qk1(q, qo, kc, ko, s, j, n, hd, scale)


@kernel(fastmath=True, inline="always")
def _value_block(H, wide, s, n, vc, vo, hd, out, oo):
    """out rows oo.. (H heads), 64 columns if wide else 16, = s (H, n) . those columns of V rows vo..."""
    if wide:
        if H == 4:
            pv4x4(s, 0, n, vc, vo, n, hd, out, oo)
        elif H == 2:
            pv2x4(s, 0, n, vc, vo, n, hd, out, oo)
        else:
            pv1x4(s, 0, n, vc, vo, n, hd, out, oo)
    elif H == 4:
        pv4x1(s, 0, n, vc, vo, n, hd, out, oo)
    elif H == 2:
        pv2x1(s, 0, n, vc, vo, n, hd, out, oo)
    else:
        pv1x1(s, 0, n, vc, vo, n, hd, out, oo)


@kernel(fastmath=True, inline="always")
def _values(H, s, n, vc, vo, hd, out, oo):
    """out rows oo.. (H heads) = s (H, n) . V rows vo.., in blocks of 64 columns, then 16."""
    k = 0
    while k < hd:
        wide = k + 64 <= hd
        _value_block(H, wide, s, n, vc, vo + k, hd, out, oo + k)
        k += 64 if wide else 16


@kernel(fastmath=True, parallel=True)
def attention(q, kc, vc, pos0, scale, out):
    """Causal GQA: q (m, n_head, hd) at positions pos0.., kc/vc (n_kv, n_ctx, hd) already holding those
    positions as float16 bit patterns (uint16, like ggml's default f16 KV cache); query head h reads kv head
    h // (n_head / n_kv). Writes out (m, n_head, hd).

    One task per (token, kv head, block of H of its query heads: 4, 2 or 1, whichever divides the group): scores
    16 (head, position) pairs at a time and the value sums with the output rows in registers (simd_attn.py),
    about 2-3x faster than plain loops; head_dim not a multiple of 16 takes the plain loops. A token's result
    depends only on its position, not on the chunk it is computed in (decode or prefill: the same bits)."""
    m, nh, hd = q.shape
    if hd % 16:
        return _attention_loops(q, kc, vc, pos0, scale, out)
    n_kv, n_ctx = kc.shape[0], kc.shape[1]
    group = nh // n_kv
    H = 4 if group % 4 == 0 else (2 if group % 2 == 0 else 1)
    P = 16 // H  # positions per score block
    nb = group // H
    for t in prange(m * n_kv * nb):
        i = t // (n_kv * nb)
        r = t - i * (n_kv * nb)
        g = r // nb
        h0 = g * group + (r - g * nb) * H
        n = pos0 + i + 1
        s = np.empty((H, n), dtype=np.float32)
        qo = (i * nh + h0) * hd
        if n >= P:
            j = 0
            while j < n:
                j = min(j, n - P)  # the last block overlaps the one before: its scores are the same bits
                _scores(H, q, qo, kc, (g * n_ctx + j) * hd, s, j, n, hd, scale)
                j += P
        else:
            for j in range(n):
                for hh in range(H):
                    s[hh, j] = _score(q, i, h0 + hh, kc, g, j) * scale
        for hh in range(H):
            mx = np.float32(-np.inf)
            for j in range(n):
                mx = max(mx, s[hh, j])
            tot = 0.0
            for j in range(n):
                e = exp32(s[hh, j] - mx)
                s[hh, j] = e
                tot += e
            inv = np.float32(1.0 / tot)
            for j in range(n):
                s[hh, j] *= inv
        _values(H, s, n, vc, g * n_ctx * hd, hd, out, qo)
    return out


@kernel(fastmath=True, parallel=True)
def _attention_loops(q, kc, vc, pos0, scale, out):
    """attention in plain loops, one task per (token, query head): any head_dim."""
    m, nh, hd = q.shape
    group = nh // kc.shape[0]
    for t in prange(nh * m):
        h = t // m
        i = t % m
        g = h // group
        n = pos0 + i + 1
        s = np.empty(n, dtype=np.float32)
        mx = np.float32(-np.inf)
        for j in range(n):
            acc = _score(q, i, h, kc, g, j) * scale
            s[j] = acc
            mx = max(mx, acc)
        tot = 0.0
        for j in range(n):
            e = exp32(s[j] - mx)
            s[j] = e
            tot += e
        inv = np.float32(1.0 / tot)
        for d in range(hd):
            out[i, h, d] = 0.0
        for j in range(n):
            pj = s[j] * inv
            for d in range(hd):
                out[i, h, d] += pj * f16_to_f32(vc[g, j, d])
    return out


@kernel(fastmath=True)
def swiglu(gate, up, out):
    """out = silu(gate) * up, elementwise over (m, n); out may be gate or up. Each row is computed into a scratch
    row, then copied: written in place, LLVM's overlap check sends the loop to its scalar version (7x slower)."""
    m, n = gate.shape
    row = np.empty(n, np.float32)
    for i in range(m):
        for j in range(n):
            g = gate[i, j]
            row[j] = g / (np.float32(1.0) + exp32(-g)) * up[i, j]
        for j in range(n):
            out[i, j] = row[j]
    return out


@kernel(fastmath=True, parallel=True)
def swiglu_rows(gate, up, out):
    """swiglu for many rows (prefill), blocks of 16 rows spread over the threads: swiglu itself, bit for bit."""
    m = gate.shape[0]
    for b in prange((m + 15) >> 4):
        swiglu(gate[16 * b : 16 * b + 16], up[16 * b : 16 * b + 16], out[16 * b : 16 * b + 16])
    return out


@kernel
def store_kv(k, v, kc, vc, pos0):
    """k, v (m, n_kv, hd) f32 -> kc, vc (n_kv, n_ctx, hd) float16 bits at positions pos0..pos0+m-1, rounded to
    nearest even as numpy's astype(float16) (which takes ~5 ns per element: ~1 ms per layer at 128 tokens)."""
    m, n_kv, hd = k.shape
    for g in range(n_kv):
        for i in range(m):
            for d in range(hd):
                kc[g, pos0 + i, d] = f32_to_f16_bits(k[i, g, d])
                vc[g, pos0 + i, d] = f32_to_f16_bits(v[i, g, d])
