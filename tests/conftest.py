"""Shared fixtures: tiny synthetic GGUFs written once per test session (the writer is the project's own;
the oracles the tests compare against are not)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

# Activations as two int8 digits on every host (int8.activation_digits reads this once, at import). AVX2's
# default, one digit (ggml's grid), flips near-tied expert routes of the tiny random models: their logits then
# leave the float64 reference's bounds (cosine down to 0.75 at such a position, 2026-12-07). One digit is checked
# per kernel against gguf-py in float64 (test_int8.py, test_decode_digits.py) and end to end against llama.cpp's
# logits, whose arithmetic it shares (test_golden.py, in a process of its own).
os.environ.setdefault("STREAM_RUN_ACT", "int16")


def pytest_sessionstart(session):
    """Kernel sources edited in place: drop their stale numba cache before any test loads a kernel. Under
    pytest-xdist, the controller then compiles the kernels most tests share (the common formats' groups of
    streamer/warmup.py) in two processes before the workers start, so the workers load them from numba's
    cache instead of each compiling them at once."""
    from streamer.kernels._cache import drop_stale_numba_cache

    drop_stale_numba_cache()
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        _compile_common_kernels()


def _compile_common_kernels() -> None:
    from gguf import GGMLQuantizationType as T

    from streamer import warmup
    from streamer.kernels.experts import FORMATS

    qtypes = {T.Q8_0, T.Q4_K, T.Q6_K}
    codes = sorted(FORMATS[q] for q in qtypes)
    combos = {
        "decode": [(f,) * 4 for f in codes],
        "decode-ffn": [(f,) * 3 for f in codes],
        "decode-moe": [(-1, f, f) for f in codes],
    }
    # common_groups: not the other ISA's integer kernels, nor the f32 expert tiles where an integer kernel runs
    warmup.warmup_shared(None, warmup.common_groups(qtypes), qtypes, combos)


# ---- test tiers: the default run (fast) and `-m slow` (the exhaustive cases) ----
# The fast tier's cost is numba compiling: each weight format outside kernels/specialise.SPECIALISED, each other
# instruction set and each other activation kind compiles kernels of its own. So a case parametrised over those runs
# in the fast tier for the formats real uploads use (Q8_0, Q4_K, Q6_K, the float types, the Q4_K_M mix), for this
# CPU's own kernels, and every other combination in the slow tier.
FAST_FORMATS = {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M"}
SLOW_VARIANTS = {"digit", "int16"}  # decode activation kinds a VNNI/AVX2 CPU does not run by default


def _formats() -> set[str]:
    from gguf import GGMLQuantizationType

    from streamer.synth.recipes import RECIPES

    return {t.name for t in GGMLQuantizationType} | set(RECIPES)


def _tier_slow(tokens: set[str], formats: set[str], host_int8: bool, host_digits: bool) -> bool:
    if (tokens & formats) - FAST_FORMATS:
        return True
    if host_int8 and "generic" in tokens:  # the portable fallback of a kernel this CPU runs natively
        return True
    return host_digits and bool(tokens & SLOW_VARIANTS)


def pytest_collection_modifyitems(config, items):
    from streamer.kernels import int8

    formats = _formats()
    host_int8, host_digits = int8.ISA is not None, int8.DECODE_ISA is not None
    for item in items:
        m = re.search(r"\[(.*)\]$", item.name)
        if m and _tier_slow(set(re.split(r"[-,\s]", m.group(1))), formats, host_int8, host_digits):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def stream_run_log():
    """The library logs; the CLI shows its lines on stderr. So do the tests: they check what a user sees."""
    from streamer.cli.app import log_to_stderr

    log_to_stderr()


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path, monkeypatch):
    """Every test (and every stream-run it starts) keeps the learned-usage sidecars and the demo model in its
    own directory, never in ~/.cache."""
    monkeypatch.setenv("STREAM_RUN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def no_prefault_threads(request, monkeypatch):
    """The expert cache's prefault threads set how far a decode step may grow the cache (experts/cache.py), by
    how fast they run; the tests count reads and hits, which needs the same choices every run. So the tests run
    without the threads, but for test_prefault.py, which tests them and drives the growth allowance itself."""
    if request.module.__name__ != "test_prefault":
        from streamer.experts import cache

        monkeypatch.setattr(cache, "PREFAULT", False)


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """synth_model(preset, qtype, **spec) -> path of a model written once per session per arguments."""
    from streamer.synth.writer import spec_for, write_model

    root = tmp_path_factory.mktemp("models")
    made: dict = {}

    def make(preset: str = "tiny", qtype: str = "Q8_0", layers=None, **kw) -> Path:
        key = (preset, qtype, layers, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([preset, qtype, str(layers)] + [f"{k}={v}" for k, v in sorted(kw.items())])
            kw.setdefault("real_vocab", False)
            made[key] = Path(write_model(root / f"{name}.gguf", spec_for(preset, qtype, layers, **kw)))
        return made[key]

    return make
