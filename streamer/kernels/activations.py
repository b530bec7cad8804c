"""Activation quantization for the block-format matvecs (ggml quantizes x to Q8_0/Q8_K likewise).

x is rounded to int16 xq with one f32 scale per group (32 elements for Q8_0/Q4_0, 256 for the
K-quants), |xq| <= XQ_MAX, so |x - xq*dx| <= dx/2 (+ f32 rounding). XQ_MAX = 2^14 - 1 keeps every
int32 lane sum of a 256-element super-block in range: 16 products/lane x 4096 (Q6_K |scale*q|)
x 16383 < 2^31. That is 128x finer than ggml's int8 activations.
"""

import numpy as np

from ._bits import kernel

XQ_MAX = 16383


# No fast-math in these two: the decode and the grouped prefill kernels inline them into different code, and
# the row dots on their results must agree bit for bit (a reassociated sum, a reciprocal for a division, differ
# with what LLVM made of the code around them). Once per activation row: their cost does not show.
@kernel()
def quantize_groups(x, xq, dx, group):
    """xq[k] = rint(x[k] / dx[g]), dx[g] = max|x in group g| / XQ_MAX."""
    for g in range(x.size // group):
        k0 = g * group
        amax = np.float32(0)
        for k in range(k0, k0 + group):
            amax = max(amax, abs(x[k]))
        dx[g] = amax / np.float32(XQ_MAX)
        inv = np.float32(XQ_MAX) / amax if amax > 0 else np.float32(0)
        for k in range(k0, k0 + group):
            xq[k] = np.int16(np.rint(x[k] * inv))


@kernel()
def group_sums(x, xs, group):
    """xs[g] = sum of x over the group-element group g (32: the K-quant min terms; 16: Q2_K's), in order."""
    for g in range(xs.size):
        s = np.float32(0)
        for k in range(group):
            s += x[g * group + k]
        xs[g] = s


# Two int8 digits per activation (q = 256 hi + lo, both within int8): the decode row dots of simd_vnni.py.
XD_MAX = 127 * 256 + 127
# One int8 digit per activation (AVX2's default, or STREAM_RUN_ACT=int8: ggml's q8 grid, per 32 elements): simd_vnni's dots, given
# the digits as a uint8 buffer.
XD1_MAX = 127
