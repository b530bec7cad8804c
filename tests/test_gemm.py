"""The f32 tile products (kernels/gemm.py), both register blocks, against numpy's float64 matmul; and the block
chosen for this CPU against what its kernel says the CPU has (/proc/cpuinfo)."""

import platform

import numpy as np
import pytest

from streamer.kernels import gemm

KERNELS = {"4x4": gemm.gemm_tile_4x4, "4x3": gemm.gemm_tile_4x3}


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 12])
@pytest.mark.parametrize("nr", [1, 2, 3, 4, 7, 16])
def test_tile_matches_float64(name, m, nr):
    rng = np.random.default_rng(m * 100 + nr)
    K, t0, c0 = 96, 2, 5  # a tile that starts inside T and writes inside out
    X = rng.standard_normal((m, K)).astype(np.float32)
    T = rng.standard_normal((t0 + nr + 3, K)).astype(np.float32)
    out = np.full((m, c0 + nr + 2), np.nan, np.float32)
    KERNELS[name](X, T, t0, nr, out, c0)
    ref = X.astype(np.float64) @ T[t0 : t0 + nr].astype(np.float64).T
    # a float32 dot of K terms, any order: |err| <= gamma_K sum |x w|, gamma_K ~ K u
    bound = 1.01 * K * 2.0**-24 * (np.abs(X).astype(np.float64) @ np.abs(T[t0 : t0 + nr]).astype(np.float64).T)
    assert np.all(np.abs(out[:, c0 : c0 + nr] - ref) <= bound)
    assert np.isnan(out[:, :c0]).all() and np.isnan(out[:, c0 + nr :]).all()  # nothing written outside


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads x86 flags")
def test_block_follows_the_cpu():
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    want = "4x4" if "avx512f" in flags else "4x3"
    assert gemm.gemm_tile is KERNELS[want]
