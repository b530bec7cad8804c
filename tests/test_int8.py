"""The int8 prefill matmul (kernels/int8.py, simd_i8.py) against gguf-py's dequantizer in float64, for every
instruction set the CPU runs: vpdpbusd (AVX512-VNNI), vpmaddubsw (AVX2: Q4_0 and Q4_K) and the generic
fallback, each forced here explicitly.
The bound is test_kernels' formula with x rounded to int8 per group (derivation in simd_i8.py's docstring)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_kernels import _tolerance, make_weight

from streamer.formats import FORMATS as F
from streamer.kernels import QMatrix, int8
from streamer.kernels.dispatch import INT8

FORMATS = sorted(INT8, key=lambda t: t.name)
ISAS = int8.usable_isas()
# (format, instruction set) pairs where that set's kernel serves the format
SERVED = [(q, isa) for q in FORMATS for isa in ISAS if int8.serves(F[q].code, isa)]
SERVED_IDS = [f"{q.name}-{isa}" for q, isa in SERVED]


def _case(qtype, n_out, n_in, m, regime, seed, isa, digits=2):
    rng = np.random.default_rng(seed)
    data, raw = make_weight(qtype, n_out, n_in, rng, regime)
    deq = dequantize(raw, qtype).reshape(n_out, n_in).astype(np.float64)
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    X[0, : n_in // 2] *= np.float32(1e3)  # groups of very different magnitudes in one row
    if m > 2:
        X[2] = 0.0  # an all-zero row: dx = 0 must give exactly 0
    w = QMatrix(data, qtype, n_in)._w
    out = np.full((m, n_out), np.nan, np.float32)
    int8.matmul(_code(qtype), w, X, out, isa, digits)
    ref = X.astype(np.float64) @ deq.T
    tol = _tolerance(qtype, raw, deq, X, (int8.group_of(_code(qtype)), int8.LEVELS[digits]))
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"{qtype.name} {isa} {n_out}x{n_in} m={m}: worst err/tol {np.max(err / tol):.3g}"
    if m > 2:
        assert np.all(out[2] == 0)
    return out


def _code(qtype):
    from streamer.formats import FORMATS as F

    return F[qtype].code


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("qtype,isa", SERVED, ids=SERVED_IDS)
def test_int8_matmul_against_oracle(qtype, isa, digits):
    # partial tiles (n_out % 32), a token tail (m % 4), one and several tiles, Qwen3 widths
    for n_out, n_in, m in [(1, 256, 2), (33, 256, 5), (70, 768, 9), (64, 2048, 4), (40, 1024, 7)]:
        _case(qtype, n_out, n_in, m, "normal", n_out * 1000 + n_in, isa, digits)


@pytest.mark.parametrize("regime", ["extreme", "subnormal"])
@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("qtype,isa", SERVED, ids=SERVED_IDS)
def test_int8_matmul_extreme_scales(qtype, isa, digits, regime):
    _case(qtype, 37, 512, 6, regime, 11, isa, digits)


@pytest.mark.parametrize("qtype,isa", SERVED, ids=SERVED_IDS)
def test_one_digit_is_exact_for_its_own_rounded_x(qtype, isa):
    """With one digit, the product is W . xh to float32 rounding, xh = q dx the activations as quantize rounded them
    (the K-quant mins take the sums of xh, as ggml's bsums, not of x: the exact sums would add dmin m (sum x -
    sum xh) per sub-block, the error of an uncentred weight, and miss this bound)."""
    rng = np.random.default_rng(21)
    n_out, n_in, m = 40, 2048, 5
    data, raw = make_weight(qtype, n_out, n_in, rng)
    deq = dequantize(raw, qtype).reshape(n_out, n_in).astype(np.float64)
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    X[1] *= np.float32(1e3)
    code = _code(qtype)
    act = int8.quantize(code, X, digits=1)
    g = int8.group_of(code)
    xh = act.xq[:m].astype(np.float64) * np.repeat(act.dx[:m].astype(np.float64), g, axis=1)
    assert np.all(np.abs(xh - X) <= np.repeat(act.dx[:m], g, axis=1) / 2 * (1 + 1e-6) + 1e-30)
    out = np.empty((m, n_out), np.float32)
    int8.matmul(code, QMatrix(data, qtype, n_in)._w, X, out, isa, 1)
    err = np.abs(out - xh @ deq.T)
    tol = _tolerance(qtype, raw, deq, xh)
    assert np.all(err <= tol), f"{qtype.name} {isa}: worst err/tol {np.max(err / tol):.3g}"


def test_two_digits_are_finer_than_one():
    """The default (int16 as two int8 digits) is far more accurate than ggml's int8 activations."""
    rng = np.random.default_rng(4)
    data, raw = make_weight(T.Q8_0, 64, 1024, rng)
    deq = dequantize(raw, T.Q8_0).reshape(64, 1024).astype(np.float64)
    X = rng.standard_normal((8, 1024)).astype(np.float32)
    ref = X.astype(np.float64) @ deq.T
    err = {}
    for digits in (1, 2):
        out = np.empty((8, 64), np.float32)
        int8.matmul(_code(T.Q8_0), QMatrix(data, T.Q8_0, 1024)._w, X, out, "generic", digits)
        err[digits] = np.abs(out - ref).max()
    assert err[2] * 50 < err[1]


@pytest.mark.slow  # an exhaustive case: every ISA / format / kernel compiled cold
@pytest.mark.parametrize(
    "qtype,isa", [(q, i) for q, i in SERVED if i != "generic"], ids=lambda v: getattr(v, "name", v)
)
def test_each_isa_and_generic_agree(qtype, isa):
    """vpdpbusd, vpmaddubsw and the generic kernel form the same exact int32 sums; only the f32 steps may round
    and contract differently (an ulp or so)."""
    a, b = (_case(qtype, 64, 1024, 8, "normal", 5, i) for i in (isa, "generic"))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_stream_run_isa_generic_forces_the_fallback():
    """STREAM_RUN_ISA=generic: QMatrix.matmul runs the generic kernel (same bits as calling it explicitly)."""
    script = (
        "import numpy as np; from gguf import GGMLQuantizationType as T; from streamer.kernels import QMatrix, int8\n"
        "rng = np.random.default_rng(0); raw = rng.integers(0, 256, (40, 8 * 34), dtype=np.uint8)\n"
        "raw.reshape(40, 8, 34)[:, :, 0:2] = np.array([0.01], np.float16).view(np.uint8)\n"
        "q = QMatrix(raw, T.Q8_0, 256); X = rng.standard_normal((6, 256)).astype(np.float32)\n"
        "out = np.empty((6, 40), np.float32); int8.matmul(0, q._w, X, out, 'generic')\n"
        "print(int8.ISA, bool(np.array_equal(q.matmul(X), out)))\n"
    )
    env = dict(os.environ, STREAM_RUN_ISA="generic")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["generic", "True"]


@pytest.mark.skipif(int8.ISA is None, reason="this CPU uses the f32 tiles")
def test_qmatrix_matmul_uses_int8_for_its_formats():
    """m > 1 on a format this CPU's int8 kernel serves goes through it: its output equals a direct call bit for
    bit; a direct call on a format that kernel does not serve (AVX2's: 8-bit codes) is refused."""
    rng = np.random.default_rng(2)
    if int8.ISA == "avx2":
        with pytest.raises(ValueError, match="avx2 integer kernel does not serve"):
            int8.matmul(_code(T.Q8_0), np.zeros((32, 34), np.uint8), np.zeros((4, 32), np.float32), np.empty((4, 32)))
    for qtype in (q for q in FORMATS if int8.serves(_code(q))):
        data, _ = make_weight(qtype, 40, 512, rng)
        q = QMatrix(data, qtype, 512)
        X = rng.standard_normal((6, 512)).astype(np.float32)
        out = np.empty((6, 40), np.float32)
        int8.matmul(_code(qtype), q._w, X, out)
        np.testing.assert_array_equal(q.matmul(X), out)


@pytest.mark.parametrize("qtype", [q for q in FORMATS if int8.group_of(_code(q)) == 32], ids=lambda q: q.name)
def test_quantize_two_digits_against_numpy(qtype):
    """int8.quantize's vectorized two-digit path (simd_i8.digits_i8) against the definition in numpy float32:
    q = rint(x * (XA_MAX / amax)), dx = amax / XA_MAX per 32 (to 1 ulp), per 4 elements 4 hi then 4 lo bytes,
    xc = -off * sum(q); xs (a tree sum) to f32 rounding; an all-zero group gives zeros."""
    rng = np.random.default_rng(9)
    X = (rng.standard_normal((5, 256)) * 3.0 ** rng.integers(-8, 8, (5, 1))).astype(np.float32)
    X[1, 32:64] = 0.0
    fmt = _code(qtype)
    act = int8.quantize(fmt, X, 2)
    L = np.float32(int8.LEVELS[2])
    G = X.reshape(5, 8, 32)
    amax = np.abs(G).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, L / amax, np.float32(0)).astype(np.float32)
    q = np.rint(G * inv[:, :, None]).astype(np.int32)
    lo = ((q + 128) & 255) - 128
    hi = (q - lo) >> 8
    want = np.stack([hi.reshape(5, 64, 4), lo.reshape(5, 64, 4)], axis=2).reshape(5, 512).astype(np.int8)
    assert np.array_equal(act.xq[:5], want)
    # the kernels' fast-math may divide by a reciprocal multiply: dx to 1 ulp
    np.testing.assert_allclose(act.dx[:5], (amax / L).astype(np.float32), rtol=2.0**-23, atol=0)
    assert np.array_equal(act.xc[:5], -int8._offset_of(fmt) * q.sum(axis=2))
    np.testing.assert_allclose(act.xs[:5], G.astype(np.float64).sum(axis=2), rtol=1e-5, atol=1e-4)
    assert np.all(act.xq[1, 64:128] == 0)
