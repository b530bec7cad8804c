"""The memory budget is a promise: the expert cache never holds more than it was given, and a run under a
cgroup memory cap equal to --ram-budget (page cache included) completes instead of being OOM-killed."""

import os
import re
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from invariants import assert_cache_consistent

from streamer.options import StreamOptions
from streamer.synth.writer import Geometry, SynthSpec, write_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

# 4 layers x 64 experts x 2.4 MiB (Q8_0, hidden 1024, expert ff 768): 612 MiB of experts, far more than the cap
STREAMING_MOE = Geometry("qwen3moe", 4, 1024, 8, 4, 128, 3072, 64, 8, 768, n_ctx=512)
CAP = "400M"


def cgroup_ok() -> bool:
    return sys.platform == "linux" and os.geteuid() == 0 and os.access("/sys/fs/cgroup/memory", os.W_OK)


@pytest.fixture(scope="module")
def streaming_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "moe.gguf"
    return write_model(path, SynthSpec(STREAMING_MOE, real_vocab=False, seed=3))


def test_cache_never_holds_more_than_given(streaming_moe, tmp_path, monkeypatch):
    from streamer.session import open_model

    monkeypatch.setenv("STREAM_RUN_CACHE", str(tmp_path))
    # the plan charges what this (long-lived) pytest process already holds, so give it that much more
    budget = psutil.Process().memory_info().rss + 300 * 2**20
    s = open_model(streaming_moe, StreamOptions(learn=False, ram_budget=budget), n_ctx=64)
    cache = s.model.ffn.source.cache
    plan = s.model.ffn.plan
    assert not plan.fits_resident and cache.capacity_bytes <= plan.expert_cache
    c = s.model.new_state()
    s.model.forward(np.arange(10), c)
    rss0 = psutil.Process().memory_info().rss
    for t in range(12):
        s.model.forward(np.array([t * 7 % 250]), c)
        assert_cache_consistent(cache)
    assert cache.evictions > 0  # it really streamed
    # the process grew by at most the arena (every slot touched) plus a little: no hidden copies of experts
    assert psutil.Process().memory_info().rss - rss0 <= cache.capacity_bytes + 32 * 2**20
    s.close()


@pytest.mark.skipif(not cgroup_ok(), reason="needs root and the cgroup-v1 memory controller")
def test_generation_under_a_cgroup_cap_equal_to_the_budget(streaming_moe, tmp_path):
    from cgroup import evict, run_capped

    from streamer.session import open_model

    # numba kernels compiled + cached here; the plan charges what this (long-lived) pytest process already holds
    # (1.79 GiB once, after other tests in the same worker: a flat 2G was then refused), so give it 2 GiB more
    budget = psutil.Process().memory_info().rss + 2 * 2**30
    open_model(streaming_moe, StreamOptions(learn=False, ram_budget=budget), n_ctx=64).close()
    evict(streaming_moe)  # start cold: pages cached by the writer were charged to us, not to the capped run
    cmd = [
        sys.executable,
        "-m",
        "streamer.cli.main",
        "run",
        str(streaming_moe),
        "-p",
        "hello there",
        "-n",
        "12",
        "--ram-budget",
        CAP,
        "-c",
        "64",
    ]
    env = dict(os.environ, STREAM_RUN_CACHE=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = run_capped(cmd, CAP, timeout=300, env=env)
    assert not res.oom_killed, res.summary()
    assert res.returncode == 0, res.stderr
    assert "experts: hit rate" in res.stderr  # it streamed and reported its traffic
    assert res.max_usage_bytes <= 400 * 2**20


def test_too_small_budget_names_a_budget_that_works(streaming_moe, monkeypatch):
    """The 'needs at least X' figure is exact: X is accepted, a little less is refused."""
    import re

    from streamer.budget import split_budget
    from streamer.config import ModelConfig
    from streamer.errors import StreamerError
    from streamer.experts.store import ExpertLayout
    from streamer.gguf_file import GGUFFile

    class FixedRSS:  # the plan charges the process's RSS: hold it still
        def memory_info(self):
            return type("m", (), {"rss": 150 * 2**20})()

    monkeypatch.setattr(psutil, "Process", FixedRSS)
    gf = GGUFFile(streaming_moe)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    args = (cfg, gf, layout.total_bytes, layout.slot_bytes, cfg.kv_bytes_per_token * 64)
    with pytest.raises(StreamerError) as err:
        split_budget(100 * 2**20, *args)
    need = float(re.search(r"needs at least ([\d.]+) MiB", str(err.value)).group(1))
    split_budget(int((need + 0.01) * 2**20), *args)  # the printed figure, rounded up to its last digit: accepted
    with pytest.raises(StreamerError):
        split_budget(int((need - 0.5) * 2**20), *args)


def test_kv_cache_is_paid_for_out_of_the_budget(streaming_moe, monkeypatch):
    """A longer context leaves exactly its extra KV bytes less for the expert cache (same budget)."""
    from streamer.session import open_model

    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: type("m", (), {"rss": 150 * 2**20})())
    plans = {
        n: open_model(streaming_moe, StreamOptions(learn=False, ram_budget="600M"), n_ctx=n).model.ffn.plan
        for n in (64, 512)
    }
    s = open_model(streaming_moe, StreamOptions(learn=False, stream=False), n_ctx=512)
    kv = {n: s.cfg.kv_bytes_per_token * n for n in (64, 512)}
    cache = s.model.new_state()
    assert cache.nbytes == kv[512]  # the plan charges what the KV cache really allocates
    assert plans[64].expert_cache - plans[512].expert_cache == kv[512] - kv[64] > 0


@pytest.mark.skipif(not cgroup_ok(), reason="needs root and the cgroup-v1 memory controller")
def test_chat_fills_its_context_under_a_cap_with_a_two_layer_budget(streaming_moe, tmp_path):
    """Five chat turns filling the context (the oldest turns are then dropped), in a cgroup capped at
    --ram-budget, with a budget whose expert cache holds about two layers' routed experts (16 of 256): never
    OOM-killed, peak usage under the cap, every turn answered."""
    import re
    import subprocess

    from cgroup import MemoryCgroup, evict

    from streamer.io import parse_size

    env = dict(os.environ, STREAM_RUN_CACHE=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    base = [
        sys.executable,
        "-m",
        "streamer.cli.main",
        "chat",
        str(streaming_moe),
        "-c",
        "160",
        "-n",
        "16",
        "--temp",
        "0",
    ]
    probe = subprocess.run(base + ["--ram-budget", "1M"], input="", capture_output=True, text=True, env=env)
    need = parse_size(re.search(r"needs at least ([\d.]+ [KMG]iB)", probe.stderr).group(1).replace(" ", ""))
    from streamer.experts.store import ExpertLayout
    from streamer.session import open_model

    s = open_model(streaming_moe, StreamOptions(learn=False, stream=False))
    slot = ExpertLayout(s.gf, s.cfg).slot_bytes
    budget = need + 8 * slot * 33 // 31 + 2**20  # one more layer's 8 experts, with the margin's 1/32 on top
    evict(streaming_moe)
    turns = "".join(f"hi {i}\n" for i in range(5))
    with MemoryCgroup(budget) as cg:
        r = subprocess.run(
            cg.wrap(base + ["--ram-budget", str(budget)]),
            input=turns,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        stats = cg.stats()
    assert stats["oom_kill_count"] == 0 and r.returncode == 0, (stats, r.returncode, r.stderr[-2000:])
    assert stats["max_usage_bytes"] <= budget
    cache_slots = re.search(r"expert cache ([\d.]+ [KMG]iB)", r.stderr).group(1).replace(" ", "")
    assert 14 <= parse_size(cache_slots) // slot <= 17  # about two layers' working set
    assert r.stderr.count("[prompt:") == 5 and "error:" not in r.stderr  # every turn answered
    assert "context full: dropped the oldest" in r.stderr  # the context did fill up


def test_a_budget_beyond_available_memory_is_warned_about(streaming_moe, monkeypatch, capsys):
    import streamer.budget as budget
    from streamer.session import open_model

    def budget_above_rss():  # measured at each open: a first open that compiles kernels grows the process
        return psutil.Process().memory_info().rss + 300 * 2**20

    open_model(streaming_moe, StreamOptions(learn=False, ram_budget=budget_above_rss()), n_ctx=64).close()
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(budget, "available_memory", lambda: 100 * 2**20)  # as if in a 100 MiB-free machine
    open_model(streaming_moe, StreamOptions(learn=False, ram_budget=budget_above_rss()), n_ctx=64).close()
    assert re.search(r"warning: --ram-budget .* is more than this process can have", capsys.readouterr().err)


def test_pages_a_pagein_mapped_are_not_counted_twice(streaming_moe, monkeypatch):
    """The non-expert weights a page-in mapped before the plan are in the process's RSS (as file pages) and
    in the plan's non-expert share: the process's share leaves them out, never more than its file pages."""
    from streamer.budget import split_budget
    from streamer.config import ModelConfig
    from streamer.experts.store import ExpertLayout
    from streamer.gguf_file import GGUFFile

    MiB = 2**20

    class Mem:
        def memory_info(self):
            return type("m", (), {"rss": 500 * MiB, "shared": 300 * MiB})()

    monkeypatch.setattr(psutil, "Process", Mem)
    gf = GGUFFile(streaming_moe)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    args = (8 * 2**30, cfg, gf, layout.total_bytes, layout.slot_bytes, cfg.kv_bytes_per_token * 64)
    none, some, more = (split_budget(*args, paged_in=lambda n=n: n * MiB) for n in (0, 200, 400))
    assert (none.baseline, some.baseline, more.baseline) == (500 * MiB, 300 * MiB, 200 * MiB)
    assert some.expert_cache - none.expert_cache == 200 * MiB and some.nonexpert == none.nonexpert


def test_without_a_budget_a_model_that_fits_whole_runs_in_place(streaming_moe, monkeypatch):
    """No --ram-budget: when every expert fits in ROOMY_FRACTION of available memory (but not in
    DEFAULT_FRACTION), the model runs in place (as llama.cpp's mmap); when it does not, it streams."""
    import streamer.budget as budget
    import streamer.session as session
    from streamer.cli import early
    from streamer.gguf_file import GGUFFile
    from streamer.session import ModelConfig, moe_fits_resident, open_model

    gf = GGUFFile(streaming_moe)
    cfg = ModelConfig.from_gguf(gf)
    lo, hi = 2**20, 64 * 2**30  # the smallest budget that keeps every expert in place
    while hi - lo > 2**20:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if moe_fits_resident(gf, cfg, 64, mid) else (mid, hi)
    monkeypatch.setattr(budget, "available_memory", lambda: int(hi / 0.98))  # 0.95 of it is short of hi
    default = budget.resolve(None)
    assert budget.roomy(default, lambda b: moe_fits_resident(gf, cfg, 64, b)) == default
    monkeypatch.setattr(budget, "available_memory", lambda: int(hi / 0.9))  # fits at 0.95, not at 0.8
    assert not moe_fits_resident(gf, cfg, 64, budget.resolve(None))
    # the CLI's entry point plans its early page-in at the budget open_model will use (session.run_budget)
    budgets = []
    plan = session.early_plan
    monkeypatch.setattr(
        session, "early_plan", lambda gf, cfg, o, b, *a, **k: budgets.append(b) or plan(gf, cfg, o, b, *a, **k)
    )
    try:
        early.start(["stream-run", "run", str(streaming_moe), "-c", "64", "--tokens", "1"])
    finally:
        early.stop()
    assert budgets == [session.run_budget(gf, cfg, StreamOptions(learn=False), 64)]
    assert budgets[0] > budget.resolve(None)  # widened: not the default share
    with open_model(streaming_moe, StreamOptions(learn=False), n_ctx=64) as s:
        assert not s.moe.source.streams
