"""The MoE prefill's few-token Q4_K kernel (kernels/lanes.py, simd_lanes.py) against gguf-py's dequantizer in
float64, with the bound derived in simd_lanes.py (test_kernels' formula, int8.quantize_act's activation grid),
for 0..16 tokens per expert (every lane width C), experts at arbitrary byte offsets, gate and up parts, and
every instruction set (vpdpbusd where the CPU has it, the generic integer dot forced explicitly)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_kernels import _tolerance, make_weight

from streamer.formats import FORMATS
from streamer.kernels import int8, lanes

Q4_K = FORMATS[T.Q4_K].code
COUNTS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 6, 0, 11, 13, 14, 15, 10]  # tokens per expert of the group


def _group(rng, n_out, n_in, regime="normal"):
    g = len(COUNTS)
    mats = [make_weight(T.Q4_K, n_out, n_in, rng, regime) for _ in range(2 * g)]
    row_bytes = mats[0][0].shape[1]
    gap = 5 * row_bytes + 16  # experts not packed back to back: offsets are honoured
    stride = n_out * row_bytes + gap
    base = np.zeros(2 * g * stride, np.uint8)
    offs = (np.arange(2 * g) * stride).reshape(2, g)
    for (data, _), o in zip(mats, offs.reshape(-1)):
        base[o : o + data.size] = data.view(np.uint8).reshape(-1)
    base.flags.writeable = False
    deq = [dequantize(raw, T.Q4_K).reshape(n_out, n_in).astype(np.float64) for _, raw in mats]
    return base, offs, row_bytes, mats, deq


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("regime", ["normal", "extreme"])
@pytest.mark.parametrize("isa", lanes.isas())
@pytest.mark.parametrize("n_out,n_in", [(40, 256), (33, 768), (16, 2048)])
def test_lanes_against_oracle(n_out, n_in, isa, regime, digits):
    rng = np.random.default_rng(n_out * 7 + n_in)
    base, offs, row_bytes, mats, deq = _group(rng, n_out, n_in, regime)
    m = 20
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    X[0, : n_in // 2] *= np.float32(1e3)  # groups of very different magnitudes in one row
    X[3] = 0.0  # an all-zero row gives exactly 0
    act = int8.quantize(Q4_K, X, digits)
    toks = [np.sort(rng.choice(m, c, replace=False)) for c in COUNTS]
    starts = np.concatenate(([0], np.cumsum(COUNTS))).astype(np.int64)
    rows = np.concatenate(toks).astype(np.int64)
    out = np.full((2, starts[-1], n_out), np.nan, np.float32)
    lanes.grouped(base, offs, row_bytes, act, rows, starts, out, isa)
    g = len(COUNTS)
    for j in range(2):
        for i, t in enumerate(toks):
            if len(t) == 0:
                continue
            raw = mats[j * g + i][1]
            ref = X[t].astype(np.float64) @ deq[j * g + i].T
            tol = _tolerance(T.Q4_K, raw, deq[j * g + i], X[t], (32, int8.LEVELS[digits]))
            got = out[j, starts[i] : starts[i + 1]]
            assert np.all(np.abs(got - ref) <= tol), (j, i, len(t), np.max(np.abs(got - ref) / tol))
            assert np.all(got[t == 3] == 0)


@pytest.mark.parametrize("isa", lanes.isas())
def test_one_digit_lanes_are_exact_for_their_own_rounded_x(isa):
    """One digit (AVX2's default): each output is W . xh to float32 rounding, xh = q dx the activations as
    int8.quantize rounded them (the mins take the sums of xh, as ggml's bsums), for every lane width."""
    rng = np.random.default_rng(5)
    n_out, n_in = 24, 768
    base, offs, row_bytes, mats, deq = _group(rng, n_out, n_in)
    m = 20
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    act = int8.quantize(Q4_K, X, 1)
    xh = act.xq[:m].astype(np.float64) * np.repeat(act.dx[:m].astype(np.float64), 32, axis=1)
    starts = np.concatenate(([0], np.cumsum(COUNTS))).astype(np.int64)
    rows = np.concatenate([rng.choice(m, c, replace=False) for c in COUNTS]).astype(np.int64)
    out = np.full((2, starts[-1], n_out), np.nan, np.float32)
    lanes.grouped(base, offs, row_bytes, act, rows, starts, out, isa)
    g = len(COUNTS)
    for j in range(2):
        for i in range(g):
            t = rows[starts[i] : starts[i + 1]]
            if len(t):
                ref = xh[t] @ deq[j * g + i].T
                tol = _tolerance(T.Q4_K, mats[j * g + i][1], deq[j * g + i], xh[t])
                err = np.abs(out[j, starts[i] : starts[i + 1]] - ref)
                assert np.all(err <= tol), (j, i, len(t), np.max(err / tol))


@pytest.mark.slow  # an exhaustive case: every ISA / format / kernel compiled cold
@pytest.mark.parametrize("digits", [1, 2])
def test_lanes_isas_agree_and_token_independent(digits):
    """vpdpbusd, its AVX2 form and the generic dot form the same integer sums (results agree to f32 rounding;
    AVX2's and the generic dot's, same lanes, are the same bits); a token's result does not depend on the other
    tokens in its lanes (only on the lane width C)."""
    rng = np.random.default_rng(2)
    n_out, n_in = 24, 512
    base, offs, row_bytes, mats, deq = _group(rng, n_out, n_in)
    X = rng.standard_normal((20, n_in)).astype(np.float32)
    act = int8.quantize(Q4_K, X, digits)
    starts = np.concatenate(([0], np.cumsum(COUNTS))).astype(np.int64)
    rows = np.concatenate([np.arange(c) for c in COUNTS]).astype(np.int64)
    outs = {}
    for isa in lanes.isas():
        outs[isa] = np.empty((2, starts[-1], n_out), np.float32)
        lanes.grouped(base, offs, row_bytes, act, rows, starts, outs[isa], isa)
    ref = outs[int8.usable_isas()[0]]
    for o in outs.values():
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if "avx2" in outs:  # the high nibbles shifted down (u) instead of masked (16 u, scale / 16): exactly equal
        assert np.array_equal(outs["avx2"], outs["generic"])
    # same tokens 0..c-1 in every expert; expert with 7 tokens vs 8 tokens share C = 2: first 7 rows equal for
    # the same weights: rebuild with every expert's weights equal to expert 0's
    same = np.zeros_like(offs) + offs[:, :1]
    out = np.empty((2, starts[-1], n_out), np.float32)
    lanes.grouped(base, same, row_bytes, act, rows, starts, out, int8.usable_isas()[-1])
    i7, i8 = COUNTS.index(7), COUNTS.index(8)
    assert np.array_equal(out[:, starts[i7] : starts[i7] + 7], out[:, starts[i8] : starts[i8] + 7])


def test_split_lanes_cuts_9_to_12_token_experts_after_8():
    """Experts with 9..12 tokens run as two passes (8 tokens in 8 lanes, the rest in 2 or 4: measured 290-313 us
    against 380 for 16 lanes at the 30B-A3B gate+up); others keep one. The oracle test above covers the results
    of such experts (COUNTS has 9..12); this checks the cut itself."""
    offs = np.array([[10, 20, 30, 40, 50], [11, 21, 31, 41, 51]])
    starts = np.array([0, 3, 12, 24, 37, 45])  # counts 3, 9, 12, 13, 8
    o, s = lanes.split_lanes(offs, starts)
    assert o.tolist() == [[10, 20, 20, 30, 30, 40, 50], [11, 21, 21, 31, 31, 41, 51]]
    assert s.tolist() == [0, 3, 11, 12, 20, 24, 37, 45]
    assert o.flags.c_contiguous and o.dtype == offs.dtype and s.dtype == starts.dtype  # the kernel's one version
    o, s = lanes.split_lanes(offs[:, :1], starts[:2])
    assert o.tolist() == [[10], [11]] and s.tolist() == [0, 3]
    o, s = lanes.split_lanes(offs, starts, lanes.SPLIT_AVX2)  # AVX2: 13..16 tokens too (T = 8 twice)
    assert o.tolist() == [[10, 20, 20, 30, 30, 40, 40, 50], [11, 21, 21, 31, 31, 41, 41, 51]]
    assert s.tolist() == [0, 3, 11, 12, 20, 24, 32, 37, 45]
