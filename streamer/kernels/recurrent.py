"""Kernels of a Gated DeltaNet layer (linear attention: qwen35moe, qwen3next), float32 like ggml's:

- conv_silu: the causal depthwise conv1d over time (kernel width K, a window of the previous K-1 inputs kept
  as state), then SiLU;
- delta_rule: per value head, the gated delta rule: S *= exp(g); S += outer(beta (v - S k), k); o = S q, with
  q and k L2-normalised and q scaled by 1/sqrt(d);
- gated_rmsnorm: per head, RMSNorm(o) * w * SiLU(z).

Each reads the state before the chunk (`cur`) and writes the state after it into another buffer (`new`), so
a forward that is interrupted leaves the committed state untouched (streamer/state.py). Tokens of a chunk run
one after another: the recurrence is exact, in the order of ggml's one-token path.
"""

import numpy as np
from numba import prange

from ._bits import kernel
from .ops import exp32


@kernel(fastmath=True, inline="always")
def _silu(x):
    return x / (np.float32(1.0) + exp32(-x))


@kernel(fastmath=True, parallel=True)
def conv_silu(x, w, cur, new, out):
    """x (m, C) inputs of positions p..p+m-1; w (C, K), w[c, K-1] weighs the newest input; cur (K-1, C) the
    inputs of positions p-K+1..p-1; out (m, C) = SiLU(conv); new (K-1, C) = the last K-1 inputs after x."""
    m, C = x.shape
    K = w.shape[1]
    for c in prange(C):
        for t in range(m):
            acc = np.float32(0.0)
            for j in range(K):
                s = t - (K - 1) + j  # the input's time, relative to the chunk
                acc += (x[s, c] if s >= 0 else cur[K - 1 + s, c]) * w[c, j]
            out[t, c] = _silu(acc)
        for r in range(K - 1):
            s = m - (K - 1) + r
            new[r, c] = x[s, c] if s >= 0 else cur[K - 1 + s, c]


@kernel(fastmath=True, inline="always")
def _l2_scale(x, t, o, d, eps):
    """1 / max(||x[t, o:o+d]||, eps) (ggml_l2_norm)."""
    ss = 0.0
    for i in range(d):
        ss += np.float64(x[t, o + i]) * x[t, o + i]
    return np.float32(1.0 / max(np.sqrt(ss), eps))


@kernel(fastmath=True, parallel=True)
def delta_rule(qkv, beta, alpha, dt, a, n_k, group, eps, cur, new, out):
    """qkv (m, (2 n_k + n_v) d) after conv_silu: q (n_k heads of d), k (n_k heads), v (n_v heads); value head h
    reads key head h // group (qwen3next: each key head serves `group` consecutive value heads), or h % n_k when
    group is 0 (qwen35moe: ggml_repeat's tiling). beta, alpha (m, n_v) projections; dt (n_v) bias, a (n_v) =
    -exp(A_log).
    cur (n_v, d, d) the state before, new (n_v, d, d) after; S[h] is (value channel, key channel).
    out (m, n_v d) = S q per token."""
    m = qkv.shape[0]
    n_v, d = cur.shape[0], cur.shape[1]
    qs = np.float32(1.0 / np.sqrt(d))
    for hh in prange(n_v):
        h = np.int64(hh)
        kh = h // group if group > 0 else h % n_k
        qo, ko, vo = kh * d, (n_k + kh) * d, 2 * n_k * d + h * d
        S = new[h]
        S[:, :] = cur[h]
        q = np.empty(d, np.float32)
        k = np.empty(d, np.float32)
        for t in range(m):
            rq, rk = _l2_scale(qkv, t, qo, d, eps) * qs, _l2_scale(qkv, t, ko, d, eps)
            for i in range(d):
                q[i] = qkv[t, qo + i] * rq
                k[i] = qkv[t, ko + i] * rk
            b = np.float32(1.0) / (np.float32(1.0) + exp32(-beta[t, h]))
            z = alpha[t, h] + dt[h]
            sp = z if z > np.float32(20.0) else np.float32(np.log1p(np.exp(np.float64(z))))  # softplus
            g = exp32(a[h] * sp)
            for j in range(d):
                sk = np.float32(0.0)
                for i in range(d):
                    S[j, i] *= g
                    sk += S[j, i] * k[i]
                dj = (qkv[t, vo + j] - sk) * b
                acc = np.float32(0.0)
                for i in range(d):
                    S[j, i] += dj * k[i]
                    acc += S[j, i] * q[i]
                out[t, h * d + j] = acc


@kernel(fastmath=True, parallel=True)
def gated_rmsnorm(o, z, w, eps, out):
    """Per token and head of d = w.size channels: out = o / sqrt(mean(o^2) + eps) * w * SiLU(z)."""
    m, n = o.shape
    d = w.shape[0]
    for t in prange(m):
        for h in range(n // d):
            ss = 0.0
            for i in range(d):
                ss += np.float64(o[t, h * d + i]) * o[t, h * d + i]
            r = np.float32(1.0 / np.sqrt(ss / d + eps))
            for i in range(d):
                j = h * d + i
                out[t, j] = o[t, j] * r * w[i] * _silu(z[t, j])
    return out


@kernel(fastmath=True, parallel=True)
def sigmoid_gate(x, gate):
    """In place: x *= sigmoid(gate), elementwise over (m, n) (gated attention's output gate)."""
    m, n = x.shape
    for t in prange(m):
        for j in range(n):
            x[t, j] *= np.float32(1.0) / (np.float32(1.0) + exp32(-gate[t, j]))
