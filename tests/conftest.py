"""Shared fixtures: tiny synthetic GGUFs written once per test session (the writer is the project's own;
the oracles the tests compare against are not)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py


def pytest_sessionstart(session):
    """Kernel sources edited in place: drop their stale numba cache before any test loads a kernel."""
    from streamer.kernels._cache import drop_stale_numba_cache

    drop_stale_numba_cache()


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
