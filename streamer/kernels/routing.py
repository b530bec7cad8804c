"""The MoE router's softmax + top-k + renormalisation in one kernel call (numpy took ~10 small array ops per
layer and token, tens of microseconds of dispatch for 128 numbers).

Per row: p = exp(logits - max) in float32, summed in float64; the k largest p by descending value, ties to
the lower expert id (numpy's stable argsort of -p); each divided by the float32 sum (the softmax over all
experts), then renormalised to sum to 1 (Qwen3's norm_topk_prob), summed in expert-rank order.
"""

import numpy as np

from ._bits import kernel


@kernel
def topk_softmax(logits, k, ids, w):
    """logits (m, n) f32 -> ids (m, k) int64, w (m, k) f32, by descending weight."""
    m, n = logits.shape
    p = np.empty(n, np.float32)
    for i in range(m):
        mx = logits[i, 0]
        for j in range(1, n):
            mx = max(mx, logits[i, j])
        s = 0.0
        for j in range(n):
            p[j] = np.exp(logits[i, j] - mx)
            s += p[j]
        s32 = np.float32(s)
        tot = np.float32(0.0)
        for t in range(k):
            best = 0
            bv = np.float32(-1.0)
            for j in range(n):
                if p[j] > bv:
                    bv = p[j]
                    best = j
            ids[i, t] = best
            w[i, t] = bv / s32
            tot += w[i, t]
            p[best] = np.float32(-2.0)  # taken
        for t in range(k):
            w[i, t] = w[i, t] / tot
