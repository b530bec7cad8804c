"""The multi-expert decode kernels against the oracle (gguf-py's dequantizer in float64) and against the
per-matrix matvec (same row dot, same activation rounding: equal up to float32 rounding, since LLVM may
contract the two compiled functions' arithmetic differently)."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from streamer.kernels import QMatrix
from streamer.kernels.experts import FORMATS, ExpertScratch, experts_down, experts_matvec
from streamer.synth.writer import random_weight

N_EXP, FF, E = 6, 96, 512  # small stack: 6 experts, gate/up 96 x 512, down 512 x 96 (96 = 3 x 32; K-quants need 256)


def _readonly(a):
    """Weights as the kernels get them in a run (read-only views): the same compiled kernel version."""
    a.flags.writeable = False
    return a


def stack(qtype, rows, cols, seed):
    return random_weight((N_EXP, rows, cols), qtype, 0.05, np.random.default_rng(seed))


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_experts_matvec_equals_per_matrix_matvec_and_oracle(qtype):
    ff = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else FF
    w = stack(qtype, ff, E, 1)
    base = _readonly(w.reshape(-1))
    per_expert = w[0].nbytes
    chosen = np.array([4, 1, 5], np.int64)
    x = np.random.default_rng(2).standard_normal(E).astype(np.float32)
    out = np.empty((len(chosen), ff), np.float32)
    s = ExpertScratch(1, E)
    experts_matvec(FORMATS[qtype], base, chosen * per_expert, w.shape[-1], x, out, s.xq[0], s.aux[0])
    for i, e in enumerate(chosen):
        per_matrix = QMatrix(w[e], qtype, E).matvec(x)
        np.testing.assert_allclose(out[i], per_matrix, rtol=1e-5, atol=1e-6 * np.abs(per_matrix).max())
        ref = dequantize(w[e], qtype).astype(np.float64) @ x.astype(np.float64)
        # x is rounded to int16 per group (step dx = max|x|/16383): error <= sum|w| * dx/2, plus f32 sums
        bound = np.abs(dequantize(w[e], qtype)).sum(1) * np.abs(x).max() / 16383 + 1e-5 * np.abs(ref).max()
        assert np.all(np.abs(out[i] - ref) <= bound)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_experts_down_adds_weighted_contributions_in_order(qtype):
    ff = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else FF
    w = stack(qtype, E, ff, 3)
    base, per_expert = _readonly(w.reshape(-1)), w[0].nbytes
    chosen = np.array([0, 2, 3, 5], np.int64)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((len(chosen), ff)).astype(np.float32)
    wts = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    start = rng.standard_normal(E).astype(np.float32)
    s = ExpertScratch(len(chosen), ff)
    out = start.copy()
    experts_down(FORMATS[qtype], base, chosen * per_expert, w.shape[-1], a, wts, out, s.xq, s.aux)
    want = start.copy()
    for i, e in enumerate(chosen):  # the per-matrix path, added in the same order
        want += wts[i] * QMatrix(w[e], qtype, ff).matvec(a[i])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # split into two groups: the same sequence of additions, so the same bits
    out2 = start.copy()
    experts_down(FORMATS[qtype], base, chosen[:2] * per_expert, w.shape[-1], a[:2], wts[:2], out2, s.xq, s.aux)
    experts_down(FORMATS[qtype], base, chosen[2:] * per_expert, w.shape[-1], a[2:], wts[2:], out2, s.xq, s.aux)
    assert np.array_equal(out, out2)


def test_stale_kernel_cache_is_dropped_under_numba_cache_dir(tmp_path, monkeypatch):
    """A kernel edit must drop cached machine code wherever numba keeps it: with NUMBA_CACHE_DIR set too (the
    experts kernels inline blocks.dot from another file; a stale copy computed new formats with old code)."""
    from pathlib import Path

    from numba.core import config
    from numba.core.caching import UserProvidedCacheLocator

    import streamer.kernels._cache as kc

    here = Path(kc.__file__).parent
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    where = tmp_path / UserProvidedCacheLocator.get_suitable_cache_subpath(str(here / "experts.py"))
    where.mkdir(parents=True)
    (where / "experts.experts_down-40.py311.nbi").write_bytes(b"old")
    (where / "kernels-source.sha").write_text("not the current sources")
    kc.drop_stale_numba_cache()
    assert not (where / "experts.experts_down-40.py311.nbi").exists()
    stamp = (where / "kernels-source.sha").read_text()
    (where / "experts.experts_down-40.py311.nbi").write_bytes(b"current")
    kc.drop_stale_numba_cache()  # sources unchanged since: kept
    assert (where / "experts.experts_down-40.py311.nbi").exists() and (
        where / "kernels-source.sha"
    ).read_text() == stamp
