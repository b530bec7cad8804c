"""A first run's kernels compile in two processes (warmup.warmup_shared): a helper takes groups from the same
list, and its machine code reaches the run through numba's on-disk cache. Cold-cache subprocesses: slow tier."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json
    from gguf import GGMLQuantizationType as T
    from streamer import warmup as W

    groups = {g.name: g for g in W.groups({T.Q8_0})}
    experts = groups["experts"].kernels
    W._claim = lambda claims, i: False  # this process claims no group: the helper (if any) takes every one

    c0 = W.compiles()
    W.warmup_shared(groups["ops"].run, ("experts",), {T.Q8_0})  # first: this process's own work
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


def test_the_shared_list_holds_the_model_s_matrix_groups_costliest_first():
    from gguf import GGMLQuantizationType as T

    from streamer import warmup as W

    matrix = {g.name for g in W._matrix_groups({T.Q8_0, T.F32})}
    jobs = W._jobs(("experts", "decode", "ops"), {T.Q8_0}, {"decode": [(0, 0, 0, 0)]}, {T.Q8_0, T.F32})
    assert {g.name for g in jobs} == {"experts", "decode", "ops"} | matrix and len(matrix) == 2
    costs = [W._cost(g) for g in jobs]
    assert costs == sorted(costs, reverse=True) and jobs[0].name == "decode"  # attn_block: the longest compile


def test_this_process_s_own_work_runs_when_the_helper_times_out(monkeypatch):
    import subprocess as sp

    from streamer import warmup as W

    class Stuck:  # a helper that never finishes: its wait times out until it is killed
        def __init__(self, *args, **kwargs):
            self.killed = False

        def wait(self, timeout=None):
            if not self.killed:
                raise sp.TimeoutExpired("helper", timeout)

        def poll(self):
            return -9 if self.killed else None

        def kill(self):
            self.killed = True

    monkeypatch.setattr(W.subprocess, "Popen", Stuck)
    monkeypatch.setenv(W.COMPILE_JOBS_ENV, "2")
    monkeypatch.setattr(W, "_claim", lambda claims, i: False)  # the stuck helper took every group
    ran = []
    W.warmup_shared(lambda: ran.append("first"), ("ops",))
    assert ran == ["first"]
