"""A first run's kernels compile in two processes (warmup.warmup_shared): a helper takes groups from the same
list, and its machine code reaches the run through numba's on-disk cache. Cold-cache subprocesses: slow tier."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from gguf import GGMLQuantizationType as T
    from streamer import warmup as W
    from streamer.kernels.experts import FORMATS

    groups = {g.name: g for g in W.groups({T.Q8_0})}
    experts = groups["experts"].kernels
    saved = [k.specialise(FORMATS[T.Q8_0]) if hasattr(k, "specialise") else k for k in experts]  # what the helper saves

    def first():  # this process's own work, then a wait until the helper has saved the experts' kernels
        groups["ops"].run()
        t0 = time.perf_counter()
        while W.compile_jobs() > 1 and not W.cached(saved) and time.perf_counter() - t0 < 120:
            time.sleep(0.2)

    c0 = W.compiles()
    W.warmup_shared(first, ("experts",), {T.Q8_0})
    print(json.dumps({"compiled": W.compiles() - c0, "ops": W._misses(groups["ops"].kernels),
                      "experts": W._misses(experts), "loaded": W.loaded(experts)}))
""")


def _run(tmp_path, jobs: int) -> dict:
    env = {"NUMBA_CACHE_DIR": str(tmp_path / f"numba-{jobs}"), "STREAM_RUN_COMPILE_JOBS": str(jobs)}
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_helper_process_compiles_what_this_one_then_loads(tmp_path):
    alone, shared = _run(tmp_path, 1), _run(tmp_path, 2)
    # alone: this process compiled the experts' kernels itself
    assert alone["experts"] > 0 and alone["ops"] > 0
    # shared: the helper compiled them; this process loaded its machine code (no compile) and ran the kernels
    assert shared["ops"] > 0
    assert shared["experts"] == 0, shared
    assert shared["loaded"] == alone["loaded"] and shared["loaded"]


def test_compile_jobs_reads_the_environment(monkeypatch):
    from streamer import warmup as W

    monkeypatch.setenv(W.COMPILE_JOBS_ENV, "1")
    assert W.compile_jobs() == 1
    monkeypatch.setenv(W.COMPILE_JOBS_ENV, "3")
    assert W.compile_jobs() == 3
    monkeypatch.delenv(W.COMPILE_JOBS_ENV)
    assert 1 <= W.compile_jobs() <= 2
