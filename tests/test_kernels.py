"""Kernels against the oracle: gguf.quants.dequantize(bytes, qtype) in float64 times the input.

Tolerance (one formula, derived once): every kernel forms each output as sums of f32 products of
values that are exact in f32 (f16/bf16 widen exactly; d*sc*q products of <=24 significant bits),
possibly split into a scale term and an offset term (Q4_K/Q5_K mins, Q4_0's -8, Q6_K's -32) and
summed in any order. Higham's bound for any-order f32 summation of n such products gives
    |out - ref| <= gamma_n * sum_k A_k |x_k|,   gamma_n ~ n u,  u = 2^-24,
where A_k is |w_k| plus the magnitude of any offset term the kernel may split off (_magnitude),
and n counts the products plus the per-block scalings (n_in + n_in/16 + 8). Gradual underflow adds
at most n_in * 2^-149.
The block-format matvecs quantize x to int16 per group of G elements (activations.py):
x_k ~ xq_k * dx_g with dx_g = max|x in g| / XQ_MAX and |x_k - xq_k dx_g| <= dx_g/2 + 4u|x_k|,
which adds sum_k A_k (dx_g/2 + 4u|x_k|) to the bound (the matmul tile path uses x exactly). Where the CPU has
AVX512-VNNI or AVX2, Q4_K's matvec (simd_vnni.py) holds x as int8 digits per group of 32, dx_g = max|x in g| /
XD_MAX with two (VNNI), / XD1_MAX with one (AVX2): the same term with those dx_g.
The integer matmul (kernels/int8.py: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, m > 1, where the CPU has VNNI) quantizes
x the same way, dx_g = max|x in g| / XA_MAX per group of 32 (16 for Q6_K): the same term with those dx_g.
"""

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

import streamer.formats
from streamer.errors import StreamerError
from streamer.kernels import SUPPORTED, QMatrix, blocks, set_threads
from streamer.kernels.activations import XD1_MAX, XD_MAX, XQ_MAX
from streamer.kernels.dispatch import INT8
from streamer.kernels.int8 import ISA as INT8_ISA, XA_MAX, group_of

U = 2.0**-24
FORMATS = list(streamer.formats.FORMATS)  # every format stream-run reads: the one table
# Byte offsets of the f16 scale fields inside one block, per format (the rest of a block is random bytes).
SCALE_FIELDS = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.IQ4_XS: (0,),
    T.IQ4_NL: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    **{q: (0,) for q in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S)},
}


def _f16_values(rng, n, regime):
    """Finite f16 values: 'normal' (1e-4..1), or 'extreme' (huge up to 65504, tiny, subnormal, zero)."""
    sign = rng.choice([-1.0, 1.0], n)
    if regime == "normal":
        return (sign * 10 ** rng.uniform(-4, 0, n)).astype(np.float16)
    if regime == "subnormal":
        return (rng.integers(1, 0x400, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)).view(
            np.float16
        )
    kind = rng.integers(0, 4, n)
    huge = sign * rng.uniform(1e3, 65504, n)
    tiny = sign * rng.uniform(6.2e-5, 1e-4, n)
    sub = _f16_values(rng, n, "subnormal").astype(np.float64)
    return np.select([kind == 0, kind == 1, kind == 2], [huge, tiny, sub], 0.0).astype(np.float16)


def make_weight(qtype, n_out, n_in, rng, regime="normal"):
    """(data as a GGUF view would give it, the same bytes as uint8 for the oracle)."""
    if qtype == T.F32:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if regime != "normal":
            w *= np.float32(10.0) ** rng.integers(-40, 30, (n_out, n_in)).astype(np.float32)
        return w, w.view(np.uint8)
    if qtype == T.F16:
        w = _f16_values(rng, n_out * n_in, regime).reshape(n_out, n_in)
        return w, w.view(np.uint8)
    if qtype == T.BF16:
        # bf16 bits with exponents kept in +-2^60 (and subnormals): sums stay finite in f32.
        f = rng.standard_normal(n_out * n_in).astype(np.float32)
        if regime != "normal":
            f *= np.float32(2.0) ** rng.integers(-60, 60, f.size).astype(np.float32)
            f[::7] = np.float32(1e-39) * rng.standard_normal(f[::7].size).astype(np.float32)
        b = (f.view(np.uint32) >> 16).astype(np.uint16).reshape(n_out, n_in)
        return b.view(np.uint8), b.view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n_in // block
    raw = rng.integers(0, 256, (n_out, nb, size), dtype=np.uint8)
    if qtype == T.MXFP4:  # E8M0 scale byte 2^(e-128): normal around 2^-8, extreme 2^-112..2^72 (sums stay finite)
        lo, hi = {"normal": (110, 125), "extreme": (16, 200), "subnormal": (16, 24)}[regime]
        raw[:, :, 0] = rng.integers(lo, hi + 1, (n_out, nb))
    if qtype == T.IQ1_M:  # the f16 scale is the top nibbles of the four u16 words at 48, lowest first
        d = _f16_values(rng, n_out * nb, regime).view(np.uint16).reshape(n_out, nb, 1)
        words = raw[:, :, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        words |= ((d >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)) << np.uint16(12)
        raw[:, :, 48:56] = words.view(np.uint8)
    for off in SCALE_FIELDS.get(qtype, ()):
        raw[:, :, off : off + 2] = _f16_values(rng, n_out * nb, regime).view(np.uint8).reshape(n_out, nb, 2)
    raw = raw.reshape(n_out, nb * size)
    return raw, raw


def _magnitude(qtype, raw, deq):
    """A >= |w| elementwise, plus any offset term a kernel may split off (see module docstring)."""
    a = np.abs(deq.astype(np.float64))
    n_out = raw.shape[0]
    if qtype in (T.Q4_K, T.Q5_K, T.Q2_K):  # w = d*sc*q - dmin*m: zero d to isolate the min term
        size = GGML_QUANT_SIZES[qtype][1]
        r = raw.reshape(n_out, -1, size).copy()
        at = SCALE_FIELDS[qtype][0]
        r[:, :, at : at + 2] = 0
        mins = np.abs(dequantize(r.reshape(n_out, -1), qtype).astype(np.float64))
        a = np.abs(deq.astype(np.float64) + mins) + mins
    elif qtype in (T.Q4_1, T.Q5_1):  # w = d*q + m, computed as two terms: |d*q| + |m|
        r = raw.reshape(n_out, -1, GGML_QUANT_SIZES[qtype][1]).copy()
        r[:, :, 2:4] = 0
        scaled = dequantize(r.reshape(n_out, -1), qtype).astype(np.float64)
        a = np.abs(scaled) + np.abs(deq.astype(np.float64) - scaled)
    elif qtype == T.Q4_0:  # d*(q-8) may be split as d*q - 8d
        d = raw.reshape(n_out, -1, 18)[:, :, 0:2].copy().view(np.float16).astype(np.float64)
        a = a + 8 * np.repeat(np.abs(d[:, :, 0]), 32, axis=1)
    elif qtype == T.Q6_K:  # d*sc*(q-32) may be split as d*sc*q - 32*d*sc
        b = raw.reshape(n_out, -1, 210)
        d = b[:, :, 208:210].copy().view(np.float16).astype(np.float64)
        sc = b[:, :, 192:208].view(np.int8).astype(np.float64)
        a = a + 32 * np.repeat(np.abs(d * sc).reshape(n_out, -1), 16, axis=1)
    return a


def activation_grid(qtype, m):
    """(group, levels) of the activation quantization the kernel for m rows uses, or None if x is used as f32:
    int16 per act_group for matvec (m == 1), or int8 digits per 32 for the formats with a digit row dot where the
    CPU has one (blocks.DIGITS; one digit with blocks.ONE_DIGIT); int8 per group_of(fmt) for the int8 matmul."""
    if m == 1:
        if blocks.DIGITS and SUPPORTED[qtype].fmt in blocks.DIGIT_CODES and SUPPORTED[qtype].act_group:
            return (32, XD1_MAX if blocks.ONE_DIGIT else XD_MAX)
        return (SUPPORTED[qtype].act_group, XQ_MAX) if SUPPORTED[qtype].act_group else None
    return (group_of(SUPPORTED[qtype].fmt), XA_MAX) if qtype in INT8 and INT8_ISA else None


def _tolerance(qtype, raw, deq, X, grid=None):
    """Per-output bound gamma_n * A|x| + n * 2^-149 [+ activation step on grid=(group, levels)] (X: [m, n_in])
    -> [m, n_out]."""
    m, n_in = X.shape
    n = n_in + n_in // 16 + 8
    a = _magnitude(qtype, raw, deq)
    ax = np.abs(X.astype(np.float64))
    tol = (n * U / (1 - n * U)) * (ax @ a.T) + n_in * 2.0**-149
    if grid is not None:
        group, levels = grid
        dx = ax.reshape(m, -1, group).max(axis=2) / levels
        step = np.repeat(dx, group, axis=1) / 2 + 4 * U * ax
        tol += step @ a.T
    return tol


def _n_ins(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 256:
        return [256, 768, 2048]  # one super-block, Qwen3 expert_ff, Qwen3-30B hidden
    if block == 32:
        return [32, 96, 1024]
    return [1, 33, 1024]


CASES = [(q, n_in, n_out) for q in FORMATS for n_in in _n_ins(q) for n_out in (1, 3, 7, 33)]


def _check(qtype, n_out, n_in, regime, seed):
    rng = np.random.default_rng(seed)
    data, raw = make_weight(qtype, n_out, n_in, rng, regime)
    deq = dequantize(raw, qtype).reshape(n_out, n_in)
    q = QMatrix(data, qtype, n_in, name="w")
    assert (q.n_out, q.n_in, q.nbytes) == (n_out, n_in, raw.nbytes)

    x = rng.standard_normal(n_in).astype(np.float32)
    ref = deq.astype(np.float64) @ x.astype(np.float64)
    err = np.abs(q.matvec(x) - ref)
    tol = _tolerance(qtype, raw, deq, x[None], activation_grid(qtype, 1))[0]
    assert np.all(err <= tol), f"matvec: worst err/tol {np.max(err / tol):.3g}"

    for m in (1, 5, 37):
        X = rng.standard_normal((m, n_in)).astype(np.float32)
        ref = X.astype(np.float64) @ deq.astype(np.float64).T
        err = np.abs(q.matmul(X) - ref)
        tol = _tolerance(qtype, raw, deq, X, activation_grid(qtype, m))
        assert np.all(err <= tol), f"matmul m={m}: worst err/tol {np.max(err / tol):.3g}"

    # Dequantization itself is exact: the same f32 values the oracle produces.
    ids = rng.integers(0, n_out, 9)
    np.testing.assert_array_equal(q.rows(ids), deq[ids])


@pytest.mark.parametrize("qtype,n_in,n_out", CASES, ids=[f"{q.name}-{i}x{o}" for q, i, o in CASES])
def test_against_oracle(qtype, n_in, n_out):
    _check(qtype, n_out, n_in, "normal", seed=n_in * 100 + n_out)


@pytest.mark.parametrize("regime", ["extreme", "subnormal"])
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_extreme_scales(qtype, regime):
    if regime == "subnormal" and qtype in (T.F32, T.BF16):
        pytest.skip("subnormal f16 scales apply to F16 and the block formats")
    _check(qtype, 33, _n_ins(qtype)[1], regime, seed=7)


@pytest.mark.parametrize("rows", [15, 16])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.F16, T.F32], ids=lambda q: q.name)
def test_f32_tiles_take_their_rows_from_the_scratch(qtype, rows):
    """The f32 tile matmuls (block, half, f32) tile W by the scratch's rows, whatever gemm.TILE this CPU has
    (16, or 15 for the 4x3 register block): 48 rows as 15 + 15 + 15 + 3 and as 16 + 16 + 16, each against the
    oracle, and nothing written past the scratch."""
    rng = np.random.default_rng(rows)
    n_out, n_in, m = 48, 256, 6
    data, raw = make_weight(qtype, n_out, n_in, rng)
    deq = dequantize(raw, qtype).reshape(n_out, n_in)
    k = SUPPORTED[qtype]
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    out = np.full((m, n_out), np.nan, np.float32)
    buf = np.full((2, rows, n_in), np.nan, np.float32)  # one thread's scratch (dispatch._tile_scratch), a guard
    set_threads(1)
    try:
        k.matmul.specialise(k.fmt)(k.fmt, np.ascontiguousarray(data).view(k.view), X, out, buf[:1])
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)
    ref = X.astype(np.float64) @ deq.astype(np.float64).T
    assert np.all(np.abs(out - ref) <= _tolerance(qtype, raw, deq, X))
    assert np.isnan(buf[1]).all()  # nothing written past the scratch


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_readonly_memmap_view_is_used_in_place(tmp_path, qtype):
    rng = np.random.default_rng(3)
    n_in = _n_ins(qtype)[1]
    data, raw = make_weight(qtype, 5, n_in, rng)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    view = np.memmap(path, dtype=data.dtype, mode="r", shape=data.shape)
    q = QMatrix(view, qtype, n_in, name="w")
    assert np.shares_memory(q._w, view)
    x = rng.standard_normal(n_in).astype(np.float32)
    deq = dequantize(raw, qtype).reshape(5, n_in)
    err = np.abs(q.matvec(x) - deq.astype(np.float64) @ x)
    assert np.all(err <= _tolerance(qtype, raw, deq, x[None], activation_grid(qtype, 1))[0])


def test_bf16_accepts_uint16_view():
    rng = np.random.default_rng(4)
    data, raw = make_weight(T.BF16, 3, 64, rng)
    x = rng.standard_normal(64).astype(np.float32)
    a = QMatrix(data, T.BF16, 64).matvec(x)
    b = QMatrix(data.view(np.uint16), T.BF16, 64).matvec(x)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0, T.Q8_K])
def test_unsupported_type_names_tensor_and_type(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.zeros((4, size * 2), np.uint8)
    with pytest.raises(StreamerError) as e:
        QMatrix(data, qtype, block * 2, name="blk.0.attn_q.weight")
    msg = str(e.value)
    assert "'blk.0.attn_q.weight'" in msg and qtype.name in msg and "Q4_K" in msg and "\n" not in msg


def test_unknown_type_number_names_tensor():
    with pytest.raises(StreamerError, match="'blk.1.ffn_up.weight' has unknown GGML type 99"):
        QMatrix(np.zeros((4, 32), np.uint8), 99, 32, name="blk.1.ffn_up.weight")


def test_wrong_out_shape_is_refused():
    q = QMatrix(np.zeros((4, 32), np.float32), T.F32, 32)
    with pytest.raises(ValueError):
        q.matvec(np.ones(32, np.float32), np.empty(3, np.float32))
    with pytest.raises(ValueError):
        q.matmul(np.ones((2, 32), np.float32), np.empty((2, 3), np.float32))


def test_wrong_row_bytes_names_tensor():
    with pytest.raises(StreamerError, match="blk.3.ffn_down.weight"):
        QMatrix(np.zeros((4, 100), np.uint8), T.Q8_0, 96, name="blk.3.ffn_down.weight")


def test_every_list_of_formats_is_the_one_table():
    """The kernels, the file check, the multi-expert kernels and the synth command's help all follow
    streamer.formats; the block-format codes are distinct within their kernel family."""
    import re

    import typer.main

    from streamer.cli.main import app
    from streamer.config import NAMES
    from streamer.kernels.experts import FORMATS as EXPERT_FORMATS

    assert set(SUPPORTED) == set(FORMATS) and NAMES.split(", ") == [t.name for t in FORMATS]
    assert set(EXPERT_FORMATS) == {t for t, f in streamer.formats.FORMATS.items() if f.family == "block"}
    for family in ("half", "block"):
        codes = [f.code for f in streamer.formats.FORMATS.values() if f.family == family]
        assert len(set(codes)) == len(codes), family
    qtype = next(p for p in typer.main.get_command(app).commands["synth"].params if p.name == "qtype")
    assert set(re.findall(r"\b(?:I?Q\w+|MXFP4|F16|BF16|F32)\b", qtype.help)) == {t.name for t in FORMATS}


def test_rows_out_of_range_and_threads():
    q = QMatrix(np.zeros((4, 32), np.float32), T.F32, 32)
    with pytest.raises(IndexError):
        q.rows(np.array([4]))
    with pytest.raises(StreamerError):
        set_threads(0)
    set_threads(1)
    try:
        assert q.matvec(np.ones(32, np.float32)).shape == (4,)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


def test_activation_quantization_step():
    from streamer.kernels.activations import quantize_groups

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1024) * 10.0 ** rng.integers(-8, 8, 1024)).astype(np.float32)
    x[256:512] = 0  # an all-zero group must give xq = 0, dx = 0
    for group in (32, 256):
        xq = np.empty(1024, np.int16)
        dx = np.empty(1024 // group, np.float32)
        quantize_groups(x, xq, dx, group)
        assert np.abs(xq.astype(np.int64)).max() <= XQ_MAX
        d = np.repeat(dx.astype(np.float64), group)
        err = np.abs(x - xq * d)
        assert np.all(err <= d / 2 + 4 * U * np.abs(x)), np.max(err / (d / 2 + 1e-300))
        assert np.all(xq[256:512] == 0)


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_zero_input_and_out_arguments(qtype):
    rng = np.random.default_rng(6)
    n_in = _n_ins(qtype)[1]
    data, _ = make_weight(qtype, 7, n_in, rng)
    q = QMatrix(data, qtype, n_in)
    out = np.full(7, np.nan, np.float32)
    assert q.matvec(np.zeros(n_in, np.float32), out) is out
    np.testing.assert_array_equal(out, 0)
    OUT = np.full((3, 7), np.nan, np.float32)
    assert q.matmul(np.zeros((3, n_in), np.float32), OUT) is OUT
    np.testing.assert_array_equal(OUT, 0)


def _mxfp4_from_the_spec(raw: np.ndarray) -> np.ndarray:
    """MXFP4 decoded straight from the OCP Microscaling spec (v1.0), not from ggml or gguf-py: each 17-byte block
    is an E8M0 scale X (2^(X-127)) and 32 E2M1 elements, element l < 16 in the low nibble of byte l, l + 16 in
    the high nibble. E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    blocks = raw.reshape(-1, 17)
    scale = 2.0 ** (blocks[:, 0].astype(np.float64) - 127)
    nib = np.concatenate([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], axis=1).astype(np.int64)
    sign = np.where(nib & 8, -1.0, 1.0)
    exp, man = (nib >> 1) & 3, nib & 1
    mag = np.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1) * (1 + 0.5 * man))
    return (scale[:, None] * sign * mag).reshape(raw.shape[0], -1)


@pytest.mark.slow  # an exhaustive case: every ISA / format / kernel compiled cold
@pytest.mark.parametrize("regime", ["normal", "extreme"])
def test_mxfp4_against_the_format_definition(regime):
    rng = np.random.default_rng(11)
    data, raw = make_weight(T.MXFP4, 9, 256, rng, regime)
    spec = _mxfp4_from_the_spec(raw)
    np.testing.assert_array_equal(QMatrix(data, T.MXFP4, 256).rows(np.arange(9)).astype(np.float64), spec)
    x = rng.standard_normal(256).astype(np.float32)
    want = spec @ x
    np.testing.assert_allclose(QMatrix(data, T.MXFP4, 256).matvec(x), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_exp32_and_swiglu_against_float64():
    """ops.exp32 (a polynomial, so that swiglu and the softmax vectorise) within float32's epsilon of float64's
    exp over its whole range, and swiglu (and swiglu_rows, bit for bit, in place or not) within a few epsilons of
    silu(g) * u."""
    from numba import njit

    from streamer.kernels import ops

    @njit(error_model="numpy")
    def exps(x, out):
        for i in range(x.size):
            out[i] = ops.exp32(x[i])
        return out

    x = np.concatenate([np.linspace(-87, 88, 1_000_001), np.random.default_rng(7).uniform(-87, 88, 100_000)])
    x = x.astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(exps(x, np.empty_like(x)) - ref) / ref
    assert rel.max() <= np.finfo(np.float32).eps, rel.max()
    clamped = exps(np.array([-1000.0, 1000.0], np.float32), np.empty(2, np.float32))  # to e**-87, e**88
    np.testing.assert_allclose(clamped, np.exp([-87.0, 88.0]), rtol=np.finfo(np.float32).eps)

    rng = np.random.default_rng(8)
    g = (rng.standard_normal((37, 768)) * 6).astype(np.float32)
    u = rng.standard_normal((37, 768)).astype(np.float32)
    gd = g.astype(np.float64)
    ref = gd / (1 + np.exp(-gd)) * u
    out = ops.swiglu(g, u, np.empty_like(g))
    assert np.all(np.abs(out - ref) <= 6 * U * np.abs(ref) + 1e-37), np.max(np.abs(out - ref) / np.abs(ref))
    np.testing.assert_array_equal(ops.swiglu_rows(g, u, np.empty_like(g)), out)
    for inplace in (ops.swiglu, ops.swiglu_rows):  # over gate or up, as the callers do: the same bits
        gg, uu = g.copy(), u.copy()
        np.testing.assert_array_equal(inplace(gg, u, gg), out)
        np.testing.assert_array_equal(inplace(g, uu, uu), out)


def _attention_f64(q, kc, vc, pos0, scale):
    """Causal GQA in float64 from the same float32 q and float16 cache: (out, sum_j p_j |v_j|, the largest
    |score| error any float32 summation order may make, the widest score range per row)."""
    m, nh, hd = q.shape
    group = nh // kc.shape[0]
    K, V = kc.view(np.float16).astype(np.float64), vc.view(np.float16).astype(np.float64)
    out, mag = np.zeros(q.shape), np.zeros(q.shape)
    ds = spread = 0.0
    for i in range(m):
        n = pos0 + i + 1
        for h in range(nh):
            g, qh = h // group, q[i, h].astype(np.float64)
            s = K[g, :n] @ qh * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h], mag[i, h] = p @ V[g, :n], p @ np.abs(V[g, :n])
            ds = max(ds, _gamma(hd + 1) * float(np.max(np.abs(K[g, :n]) @ np.abs(qh))) * scale)
            spread = max(spread, float(s.max() - s.min()))
    return out, mag, ds, spread


def _gamma(n):
    return n * U / (1 - n * U)


# (n_head, n_kv, head_dim): query heads per KV head 8, 2, 7 and 1 (score blocks of 4, 2, 1 heads); head_dim
# 128 and 64 (value blocks of 64 columns), 80 and 48 (blocks of 16 after or instead), 72 (the plain loops)
ATTN_SHAPES = [(32, 4, 128), (4, 2, 64), (7, 1, 80), (3, 3, 48), (4, 2, 72)]


@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=[f"{h}h{k}kv{d}" for h, k, d in ATTN_SHAPES])
def test_attention_against_float64(shape):
    """ops.attention against float64 softmax(q.K) V from the same float16 cache, within the bound of its float32
    arithmetic: each score off by at most gamma_{hd+1} scale sum_d |q_d k_d| (any-order sum), the softmax's
    exp32, subtraction and scaling a few u relative (u times the score range for the subtraction), and the value
    sum gamma_{n+2} relative to sum_j p_j |v_j|. Decode (one token) at positions around the score blocks' edges
    (fewer cached positions than a block, exactly one, one more), and a prefill chunk. Each token of a chunk gets
    the same bits as when it is decoded alone at its position."""
    from streamer.kernels import ops

    nh, nkv, hd = shape
    rng = np.random.default_rng(hd + nh)
    n_ctx = 160
    kc = (rng.standard_normal((nkv, n_ctx, hd)) * 2).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((nkv, n_ctx, hd)).astype(np.float16).view(np.uint16)
    scale = np.float32(1 / np.sqrt(hd))
    for m, pos0 in [(1, 0), (1, 2), (1, 3), (1, 15), (1, 16), (1, 130), (1, 159), (21, 7)]:
        q = (rng.standard_normal((m, nh, hd)) * 2).astype(np.float32)
        got = ops.attention(q, kc, vc, pos0, scale, np.empty_like(q))
        ref, mag, ds, spread = _attention_f64(q, kc, vc, pos0, scale)
        bound = (2 * ds + (spread + 6) * U) * mag + _gamma(pos0 + m + 2) * mag
        err = np.abs(got - ref)
        assert np.all(err <= bound), (m, pos0, float(np.max(err / bound)))
        if m > 1:
            for i in range(m):
                alone = ops.attention(q[i : i + 1], kc, vc, pos0 + i, scale, np.empty_like(q[:1]))
                np.testing.assert_array_equal(alone[0], got[i])
