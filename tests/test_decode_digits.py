"""The decode row dots over int8 activation digits (kernels/simd_vnni.py: vpdpbusd, or its AVX2 form) and the int16
path they replace where the CPU has AVX512-VNNI or AVX2, both called explicitly, against gguf-py's dequantizer in
float64 with test_kernels' bound: the int16 path's activation grid is (256, XQ_MAX), the digits' (32, XD_MAX).
Which one a model uses is chosen in Python (blocks.DIGITS, from int8.decode_isa); STREAM_RUN_ISA=generic forces
int16. Where the CPU has VNNI, the AVX2 form gives vpdpbusd's bits."""

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_kernels import U, _tolerance, make_weight

from streamer.formats import FORMATS
from streamer.kernels import QMatrix, blocks, int8
from streamer.kernels.activations import XD1_MAX, XD_MAX, XQ_MAX
from streamer.kernels.experts import experts_down, experts_matvec
from streamer.kernels.simd_avx2 import FOLD

VNNI = "vnni" in int8.usable_isas()
DIGITS_CPU = VNNI or int8.host_has_avx2()
needs_digits = pytest.mark.skipif(
    not DIGITS_CPU, reason="this CPU has neither AVX512-VNNI nor AVX2: the int16 path only"
)
DIGIT_TYPES = [t for t, f in FORMATS.items() if f.family == "block" and f.code in blocks.DIGIT_CODES]
# the two-digit grid: one scale per 256 with simd_avx2's folded AVX2 body, per 32 with vpdpbusd
GRID = {"int16": (256, XQ_MAX), "digits": (256 if FOLD else 32, XD_MAX), "digit": (32, XD1_MAX)}


def _buffer(kind, n_in, *lead):
    """int16, two int8 digits per element (typed int8), or one (STREAM_RUN_ACT=int8: the bytes typed uint8)."""
    xq = np.empty((*lead, n_in), np.int16)
    return {"int16": xq, "digits": xq.view(np.int8), "digit": xq.view(np.uint8)}[kind]


def _x(rng, n_in):
    """Activations with groups of very different magnitudes, an all-zero group and one huge value."""
    x = rng.standard_normal(n_in).astype(np.float32)
    x[: n_in // 2] *= np.float32(1e3)
    x[32:64] = 0
    x[-1] = np.float32(3e4)
    return x


def _matvec(kind, qtype, n_out, n_in, regime, seed, strided=False):
    rng = np.random.default_rng(seed)
    data, raw = make_weight(qtype, n_out, n_in, rng, regime)
    deq = dequantize(raw, qtype).reshape(n_out, n_in).astype(np.float64)
    w = QMatrix(data, qtype, n_in)._w
    x = _x(rng, n_in)
    if strided:  # the same values in a non-contiguous view (the kernels' scalar quantizer)
        x = np.repeat(x, 2)[::2]
    out = np.full(n_out, np.nan, np.float32)
    aux = np.empty(3 * (n_in // 32) + 1, np.float32)
    blocks.block_matvec(FORMATS[qtype].code, w, x, out, _buffer(kind, n_in), aux)
    ref = deq @ x.astype(np.float64)
    tol = _tolerance(qtype, raw, deq, x[None], GRID[kind])[0]
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"{qtype.name} {kind} {n_out}x{n_in}: worst err/tol {np.max(err / tol):.3g}"
    return out, ref


KINDS = ["int16", pytest.param("digits", marks=needs_digits), pytest.param("digit", marks=needs_digits)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", DIGIT_TYPES, ids=[t.name for t in DIGIT_TYPES])
def test_matvec_against_oracle(qtype, kind):
    for n_out, n_in in [(1, 256), (7, 768), (33, 2048), (5, 4352)]:  # one super-block .. 17 (odd count)
        _matvec(kind, qtype, n_out, n_in, "normal", n_out * 100 + n_in)


@pytest.mark.parametrize("regime", ["extreme", "subnormal"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", DIGIT_TYPES, ids=[t.name for t in DIGIT_TYPES])
def test_matvec_extreme_scales(qtype, kind, regime):
    _matvec(kind, qtype, 33, 768, regime, 9)


@pytest.mark.parametrize("kind", KINDS)
def test_matvec_of_a_strided_x(kind):
    """A non-contiguous x gives the same bits as a contiguous one (streamed == resident relies on it)."""
    for qtype in DIGIT_TYPES:
        a, _ = _matvec(kind, qtype, 7, 768, "normal", 4, strided=True)
        b, _ = _matvec(kind, qtype, 7, 768, "normal", 4)
        assert np.array_equal(a, b)


@pytest.mark.slow  # an exhaustive case: every ISA / format / kernel compiled cold
@needs_digits
@pytest.mark.parametrize("qtype", DIGIT_TYPES, ids=[t.name for t in DIGIT_TYPES])
def test_digits_are_at_least_as_accurate_as_int16(qtype):
    """Two int8 digits (32639 levels per 32 elements, or per 256 with the folded AVX2 body) vs int16 (16383 per 256):
    the digits' error is smaller overall."""
    errs = {}
    for kind in GRID:
        out, ref = _matvec(kind, qtype, 256, 2048, "normal", 3)
        errs[kind] = np.sqrt(np.mean((out - ref) ** 2))
    assert errs["digits"] < 0.7 * errs["int16"], errs


def _digits(x, digits, per256=False):
    """simd_vnni.digits32 (or, per256, digits256) on every super-block of x: (each element's byte position in its
    layout, the digit bytes (int8), dx, xs)."""
    from numba import njit

    from streamer.kernels.simd_vnni import SB_BYTES, SB_BYTES1, digit_offset, digits32, digits256

    @njit
    def vector(x, xd, dx, xs):
        for b in range(x.size >> 8):
            digits32(x, xd, dx, xs, b)

    @njit
    def vector256(x, xd, dx, xs):
        for b in range(x.size >> 8):
            digits256(x, xd, dx, xs, b)

    if per256:
        vector = vector256
    n = x.size
    sb = SB_BYTES if digits == 2 else SB_BYTES1
    pos = np.array([sb * (e // 256) + digit_offset(e % 256, digits) for e in range(n)])
    xd, dx, xs = np.empty(digits * n, np.int8), np.empty(n // 32, np.float32), np.empty(n // 32, np.float32)
    vector(x, xd if digits == 2 else xd.view(np.uint8), dx, xs)
    return pos, xd, dx, xs


@pytest.mark.parametrize("digits,per256", [(2, False), (1, False), (2, True)])
def test_quantize_digits_step_and_layout(digits, per256):
    """Each element's digits, read back from simd_vnni's layout (digit_offset), give q with |x - q dx| <= dx/2 +
    4u|x|: simd_vnni.digits32 into an int8 buffer, two digits both within int8's symmetric range and
    |q| <= XD_MAX, or into a uint8-typed one, one digit with |q| <= 127; every byte written once, an all-zero group
    exactly zero, and f32 sums per group. simd_vnni.digits256 (per256): the same, with dx = max|x| / XD_MAX over
    each super-block in all 8 of its groups' slots."""
    rng = np.random.default_rng(5)
    n = 1024
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
    x[256:288] = 0
    if per256:
        x[768:1024] = 0  # an all-zero super-block
    pos, xd, dx, xs = _digits(x, digits, per256)
    if per256:
        amax = np.abs(x).reshape(-1, 256).max(axis=1)
        assert np.array_equal(dx, np.repeat((amax / np.float32(XD_MAX)).astype(np.float32), 8))
    if digits == 2:
        assert sorted(np.concatenate([pos, pos + 64])) == list(range(2 * n))
        hi, lo = xd[pos].astype(np.int64), xd[pos + 64].astype(np.int64)
        assert np.abs(hi).max() <= 127 and np.abs(lo).max() <= 128
        q = 256 * hi + lo
        assert np.abs(q).max() <= XD_MAX
    else:
        assert sorted(pos) == list(range(n))
        q = xd[pos].astype(np.int64)
        assert np.abs(q).max() <= XD1_MAX
    d = np.repeat(dx.astype(np.float64), 32)
    assert np.all(np.abs(x - q * d) <= d / 2 + 4 * U * np.abs(x))
    assert np.all(q[256:288] == 0) and (per256 or dx[8] == 0)
    if per256:
        assert np.all(q[768:] == 0) and np.all(dx[24:] == 0) and np.all(xs[24:] == 0)
    if digits == 1:  # the sums of the rounded x (ggml's bsums), for the mins: float(sum q) dx, one rounding
        assert np.array_equal(xs, q.reshape(-1, 32).sum(axis=1).astype(np.float32) * dx)
        return
    sums = x.astype(np.float64).reshape(-1, 32).sum(axis=1)
    np.testing.assert_allclose(xs, sums, rtol=1e-5, atol=1e-6 * np.abs(x).reshape(-1, 32).sum(axis=1).max())


@needs_digits
@pytest.mark.parametrize("qtype", DIGIT_TYPES, ids=[t.name for t in DIGIT_TYPES])
def test_one_digit_is_exact_for_its_own_rounded_x(qtype):
    """One digit: the row dot is W . xh to float32 rounding, xh = q dx the activations as digits32 rounded them
    (the mins take the sums of xh, as ggml's bsums; with the exact sums of x it missed this bound 6.6x)."""
    rng = np.random.default_rng(22)
    n_out, n_in = 64, 2048
    data, raw = make_weight(qtype, n_out, n_in, rng)
    deq = dequantize(raw, qtype).reshape(n_out, n_in).astype(np.float64)
    x = _x(rng, n_in)
    pos, xd, dx, _ = _digits(x, 1)
    xh = xd[pos] * np.repeat(dx.astype(np.float64), 32)
    out = np.empty(n_out, np.float32)
    aux = np.empty(3 * (n_in // 32) + 1, np.float32)
    blocks.block_matvec(FORMATS[qtype].code, QMatrix(data, qtype, n_in)._w, x, out, _buffer("digit", n_in), aux)
    err = np.abs(out - deq @ xh)
    tol = _tolerance(qtype, raw, deq, xh[None])[0]
    assert np.all(err <= tol), f"worst err/tol {np.max(err / tol):.3g}"


@needs_digits
@pytest.mark.parametrize("qtype", DIGIT_TYPES, ids=[t.name for t in DIGIT_TYPES])
def test_one_digit_is_within_its_bound_and_coarser_than_two(qtype):
    """One int8 digit per 32 elements (ggml's q8 grid): within the bound of its 127 levels (checked in _matvec), and
    the cost of that grid is visible: its error exceeds the two digits'."""
    errs = {}
    for kind in ("digits", "digit"):
        out, ref = _matvec(kind, qtype, 256, 2048, "normal", 3)
        errs[kind] = np.sqrt(np.mean((out - ref) ** 2))
    assert errs["digit"] > 10 * errs["digits"], errs


@pytest.mark.parametrize("kind", KINDS)
def test_expert_kernels_with_either_buffer(kind):
    """The multi-expert decode kernels, given either activation buffer, equal block_matvec with the same one bit
    for bit (the same row dot) and the oracle within the bound."""
    qtype = T.Q4_K
    rng = np.random.default_rng(8)
    n_exp, rows, E = 4, 33, 512
    data, raw = make_weight(qtype, n_exp * rows, E, rng)
    w = QMatrix(data, qtype, E)._w
    row_bytes = w.shape[1]
    base = w.reshape(-1)
    chosen = np.array([3, 0, 2], np.int64)
    offs = chosen * rows * row_bytes
    x = _x(rng, E)
    code = FORMATS[qtype].code
    out = np.empty((len(chosen), rows), np.float32)
    experts_matvec(code, base, offs, row_bytes, x, out, _buffer(kind, E), np.empty(3 * E // 32 + 1, np.float32))
    deq = dequantize(raw, qtype).reshape(n_exp, rows, E).astype(np.float64)
    a = np.stack([_x(rng, E) for _ in chosen])
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    down = np.zeros(rows, np.float32)
    aux = np.empty((len(chosen), 3 * E // 32 + 1), np.float32)
    experts_down(code, base, offs, row_bytes, a, wts, down, _buffer(kind, E, len(chosen)), aux)
    want = np.zeros(rows, np.float32)
    for i, e in enumerate(chosen):
        one = np.empty(rows, np.float32)
        aux1 = np.empty(3 * E // 32 + 1, np.float32)
        blocks.block_matvec(code, w[e * rows : (e + 1) * rows], x, one, _buffer(kind, E), aux1)
        assert np.array_equal(out[i], one)
        ref = deq[e] @ x.astype(np.float64)
        tol = _tolerance(qtype, raw.reshape(n_exp, rows, -1)[e], deq[e], x[None], GRID[kind])[0]
        assert np.all(np.abs(out[i] - ref) <= tol)
        blocks.block_matvec(code, w[e * rows : (e + 1) * rows], a[i], one, _buffer(kind, E), aux1)
        want += wts[i] * one
    np.testing.assert_allclose(down, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _qmatrix_script():
    return (
        "import numpy as np; from gguf import GGMLQuantizationType as T; from streamer.kernels import QMatrix, blocks\n"
        "rng = np.random.default_rng(0); raw = rng.integers(0, 256, (40, 8 * 144), dtype=np.uint8)\n"
        "raw.reshape(40, 8, 144)[:, :, 0:4] = np.array([0.01, 0.002], np.float16).view(np.uint8)\n"
        "q = QMatrix(raw, T.Q4_K, 2048); x = rng.standard_normal(2048).astype(np.float32)\n"
        "out = np.empty(40, np.float32); xq = np.empty(2048, np.int16)\n"
        "xq = xq.view(np.uint8 if blocks.ONE_DIGIT else np.int8) if blocks.DIGITS else xq\n"
        "blocks.block_matvec(7, q._w, x, out, xq, np.empty(193, np.float32))\n"
        "print(blocks.DIGITS, q._xq.dtype, bool(np.array_equal(q.matvec(x), out)))\n"
    )


@pytest.mark.parametrize("isa,act", [("generic", ""), ("", ""), ("", "int8"), ("", "int16"), ("generic", "int8")])
def test_stream_run_isa_picks_the_decode_path(isa, act):
    """STREAM_RUN_ISA=generic: QMatrix.matvec runs the int16 row dot (same bits as calling it explicitly); by
    default the two-digit path where the CPU has VNNI, the one-digit path where it has AVX2 only;
    STREAM_RUN_ACT=int8 asks for one digit, =int16 for two."""
    env = dict(os.environ, STREAM_RUN_ISA=isa, STREAM_RUN_ACT=act)
    p = subprocess.run([sys.executable, "-c", _qmatrix_script()], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    digits = DIGITS_CPU and isa == ""
    one = act == "int8" or (act == "" and not VNNI)
    dtype = ("uint8" if one else "int8") if digits else "int16"
    assert p.stdout.split() == [str(digits), dtype, "True"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["Q4_K", "Q6_K"])
def test_row_pairs_equal_single_rows(qtype, kind):
    """block_matvec takes rows in pairs (blocks.dot2: Q4_K's two-row intrinsics, two dots otherwise), the last
    alone when their number is odd: each row agrees with blocks.dot's one-row dot to float32 rounding (the same
    operations; LLVM may order the fast-math sums of the accumulators otherwise, so the kernels pair rows the same
    way in every path), whichever rows are paired, and is within the oracle's bound."""
    from numba import njit

    code = FORMATS[qtype].code  # a constant inside the kernels below: they compile this format's code only, as
    # the model's specialised kernels do (a runtime code compiles all 23 formats': 10-20 s per case)

    @njit
    def one_by_one(w, x, out, xq, aux):
        dx, xs = blocks.prepare(code, x, xq, aux)
        for r in range(w.shape[0]):
            out[r] = blocks.dot(code, w, r * w.shape[1], xq, dx, xs, x.size)

    @njit
    def shifted_pairs(w, x, out, xq, aux):  # row 0 alone, then (1, 2), (3, 4), ...
        dx, xs = blocks.prepare(code, x, xq, aux)
        rb = w.shape[1]
        out[0] = blocks.dot(code, w, 0, xq, dx, xs, x.size)
        for r in range(1, w.shape[0] - 1, 2):
            out[r], out[r + 1] = blocks.dot2(code, w, r * rb, rb, xq, dx, xs, x.size)

    for n_out, n_in, seed in [(9, 768, 1), (6, 2048, 2), (2, 256, 3)]:
        out, ref = _matvec(kind, qtype, n_out, n_in, "normal", seed)
        rng = np.random.default_rng(seed)
        data, _ = make_weight(qtype, n_out, n_in, rng)
        w = QMatrix(data, qtype, n_in)._w
        x = _x(rng, n_in)
        aux = np.empty(3 * (n_in // 32) + 1, np.float32)
        single = np.full(n_out, np.nan, np.float32)
        one_by_one(w, x, single, _buffer(kind, n_in), aux)
        scale = np.abs(single).max()
        np.testing.assert_allclose(out, single, rtol=0, atol=2e-6 * scale)
        if n_out % 2:
            shifted = np.full(n_out, np.nan, np.float32)
            shifted_pairs(w, x, shifted, _buffer(kind, n_in), aux)
            np.testing.assert_allclose(shifted, single, rtol=0, atol=2e-6 * scale)
            assert np.all(np.abs(shifted - ref) <= np.abs(out - ref) + 4e-6 * scale)


def _pairs_and_single(isa_dots, kind, per256):
    """Q4_K rows 0-5 in pairs and row 0 alone with the given (one-row, two-row) dots, over a buffer quantized by
    simd_vnni.digits32 (a scale per 32 elements) or, per256, digits256 (one per super-block)."""
    from numba import njit

    from streamer.kernels.simd_vnni import digits32, digits256

    one, two = isa_dots[:2]
    rng = np.random.default_rng(5)
    n_in, n_out = 2048, 6
    data, _ = make_weight(T.Q4_K, n_out, n_in, rng, "normal")
    w = QMatrix(data, T.Q4_K, n_in)._w
    row, ng = w.shape[1], n_in >> 5

    @njit
    def run(w, x, xq, aux, out):  # rows in pairs with `two`, then row 0 again alone with `one`
        dx, xs = aux[:ng], aux[ng : 2 * ng]
        for b in range(ng >> 3):
            if per256:
                digits256(x, xq, dx, xs, b)
            else:
                digits32(x, xq, dx, xs, b)
        for r in range(0, out.size - 1, 2):
            out[r], out[r + 1] = two(w, r * row, row, xq, dx, xs, n_in >> 8, 512)
        out[-1] = one(w, 0, xq, dx, xs, n_in >> 8, 512)

    out = np.zeros(n_out + 1, np.float32)
    run(w, _x(rng, n_in), _buffer(kind, n_in), np.empty(2 * ng, np.float32), out)
    return out


@needs_digits
def test_folded_avx2_body_equals_the_per_sub_block_one():
    """simd_avx2's folded body (sub-block scales inside vpmaddwd, one f32 conversion per super-block) against
    simd_vnni's AVX2 body (one f32 scale per sub-block) on the same digits256 buffer: the same exact integer
    sums, so equal to float32 rounding (the f32 operations are associated otherwise)."""
    from streamer.kernels.simd_avx2 import fold_row_dots
    from streamer.kernels.simd_vnni import row_dots

    folded = _pairs_and_single(fold_row_dots(), "digits", True)
    per_sub = _pairs_and_single(row_dots("avx2"), "digits", True)
    scale = np.abs(per_sub).max()
    np.testing.assert_allclose(folded, per_sub, rtol=0, atol=2e-6 * scale)
    assert not np.array_equal(folded, np.zeros_like(folded))


@pytest.mark.skipif(not VNNI, reason="compares with vpdpbusd: this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("kind", ["digits", "digit"])
def test_avx2_form_gives_vpdpbusd_bits(kind):
    """simd_vnni's AVX2 form of the 4-product sums (vpmaddubsw, vpmaddwd) against vpdpbusd, one and two rows: the
    same bits (per-32 scales). The AVX2 decode's bodies (folded two digits on the per-256 buffer, summed one
    digit) agree with vpdpbusd to float32 rounding."""
    from streamer.kernels.simd_avx2 import fold_row_dots
    from streamer.kernels.simd_vnni import row_dots

    outs = [_pairs_and_single(row_dots(isa), kind, False) for isa in ("vnni", "avx2")]
    assert abs(outs[0][-1] - outs[0][0]) <= 1e-5 * abs(outs[0][0])  # row 0 alone ~ row 0 in a pair
    assert np.array_equal(outs[0], outs[1])
    if kind == "digits":
        a, b = (_pairs_and_single(d, kind, True) for d in (row_dots("vnni"), fold_row_dots()))
    else:  # the AVX2 one-digit body sums each sub-block in integers first: the same digits, fewer f32 roundings
        a, b = outs[0], _pairs_and_single(fold_row_dots(), kind, False)
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * np.abs(a).max())


def _token_dots(n_tok, dots=None):
    """A kernel (w, X, xq, aux, toks, out, ref): X's rows prepared into xq/aux, then out[p, r], out[p, r + 1] for
    the row pairs of w and the tokens toks[p..] n_tok at a time (blocks.dot2_tokens, or with dots = (dot2, its 2-
    and 3-token forms) those intrinsics on the layout of the digits they take), ref the same by dot2 per token."""
    from numba import njit

    code = FORMATS[T.Q4_K].code
    dot2, dot2x2, dot2x3 = dots if dots else (None, None, None)
    production = dots is None

    @njit
    def run(w, X, xq, aux, toks, out, ref):
        ng = X.shape[1] >> 5
        nb = X.shape[1] >> 8
        for t in range(X.shape[0]):
            if production:
                blocks.prepare(code, X[t], xq[t], aux[t])
            else:
                for b in range(nb):
                    digits32(X[t], xq[t], aux[t, :ng], aux[t, ng : 2 * ng], b)
        rb = w.shape[1]
        for r in range(0, w.shape[0], 2):
            for p in range(toks.size):
                t = toks[p]
                if production:
                    ref[p, r], ref[p, r + 1] = blocks.dot2(
                        code, w, r * rb, rb, xq[t], aux[t, :ng], aux[t, ng : 3 * ng], X.shape[1]
                    )
                else:
                    ref[p, r], ref[p, r + 1] = dot2(w, r * rb, rb, xq[t], aux[t, :ng], aux[t, ng : 3 * ng], nb, 512)
            p = 0
            while p < toks.size:
                if production:
                    k = blocks.dot2_tokens(code, w, r * rb, rb, xq, aux, toks, p, min(n_tok, toks.size - p), out, r)
                elif n_tok == 2:
                    t0, t1 = toks[p], toks[p + 1]
                    out[p, r], out[p + 1, r], out[p, r + 1], out[p + 1, r + 1] = dot2x2(
                        w, r * rb, rb, xq[t0], aux[t0, :ng], aux[t0, ng : 3 * ng], xq[t1], aux[t1, :ng],
                        aux[t1, ng : 3 * ng], nb, 512,
                    )  # fmt: skip
                    k = 2
                else:
                    t0, t1, t2 = toks[p], toks[p + 1], toks[p + 2]
                    a0, a1, a2, b0, b1, b2 = dot2x3(
                        w, r * rb, rb, xq[t0], aux[t0, :ng], aux[t0, ng : 3 * ng], xq[t1], aux[t1, :ng],
                        aux[t1, ng : 3 * ng], xq[t2], aux[t2, :ng], aux[t2, ng : 3 * ng], nb, 512,
                    )  # fmt: skip
                    out[p, r], out[p + 1, r], out[p + 2, r], out[p, r + 1], out[p + 1, r + 1], out[p + 2, r + 1] = (
                        a0, a1, a2, b0, b1, b2,
                    )  # fmt: skip
                    k = 3
                p += k

    from streamer.kernels.simd_vnni import digits32

    return run


@needs_digits
@pytest.mark.parametrize("kind", ["digits", "digit"])
@pytest.mark.parametrize("n_tok", [2, 3])
def test_rows_shared_by_tokens_give_each_tokens_dot2_bits(kind, n_tok):
    """blocks.dot2_tokens (the MoE prefill's experts with 2-3 tokens: a row pair read once for all of them) gives
    each token blocks.dot2's bits, and dot2 is within gguf-py's float64 bound for each token."""
    rng = np.random.default_rng(11)
    n_out, n_in = 6, 2048
    data, raw = make_weight(T.Q4_K, n_out, n_in, rng, "normal")
    deq = dequantize(raw, T.Q4_K).reshape(n_out, n_in).astype(np.float64)
    w = QMatrix(data, T.Q4_K, n_in)._w
    X = np.stack([_x(rng, n_in) * np.float32(s) for s in (1, 0.01, 3, 0.5)])
    toks = np.array([2, 0, 3, 1, 0, 2][: 2 * n_tok if n_tok == 3 else 4], np.int64)  # tokens may repeat
    out, ref = (np.full((toks.size, n_out), np.nan, np.float32) for _ in range(2))
    aux = np.empty((len(X), 3 * (n_in // 32) + 1), np.float32)
    _token_dots(n_tok)(w, X, _buffer(kind, n_in, len(X)), aux, toks, out, ref)
    assert np.array_equal(out, ref)
    for p, t in enumerate(toks):
        tol = _tolerance(T.Q4_K, raw, deq, X[t][None], GRID[kind])[0]
        assert np.all(np.abs(ref[p] - deq @ X[t].astype(np.float64)) <= tol)


@needs_digits
@pytest.mark.parametrize("isa", ["avx2", pytest.param("vnni", marks=pytest.mark.skipif(not VNNI, reason="no VNNI"))])
@pytest.mark.parametrize("kind", ["digits", "digit"])
def test_token_forms_of_each_isas_bodies_give_dot2_bits(isa, kind):
    """The 2- and 3-token row dots of each body set (the AVX2 one: folded two digits, summed one digit; vpdpbusd's)
    give its two-row dot's bits per token, whichever this CPU's kernels use (digits32's layout: the AVX2 folded
    body's grid wants one scale per 256, so its values are only compared with each other here)."""
    from streamer.kernels.simd_avx2 import fold_row_dots
    from streamer.kernels.simd_vnni import row_dots

    dots = fold_row_dots() if isa == "avx2" else row_dots("vnni")
    rng = np.random.default_rng(12)
    n_out, n_in = 4, 1024
    data, _ = make_weight(T.Q4_K, n_out, n_in, rng, "normal")
    w = QMatrix(data, T.Q4_K, n_in)._w
    X = np.stack([_x(rng, n_in) for _ in range(3)])
    for n_tok in (2, 3):
        toks = np.arange(3)[:n_tok] if n_tok == 3 else np.array([2, 0, 1, 1])
        out, ref = (np.full((toks.size, n_out), np.nan, np.float32) for _ in range(2))
        aux = np.empty((3, 3 * (n_in // 32) + 1), np.float32)
        _token_dots(n_tok, (dots[1], dots[2], dots[3]))(w, X, _buffer(kind, n_in, 3), aux, toks, out, ref)
        assert np.array_equal(out, ref)
        assert np.all(np.isfinite(ref)) and np.abs(ref).max() > 0
