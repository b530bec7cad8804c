"""The memory budget is a promise: the expert cache never holds more than it was given, and a run under a
cgroup memory cap equal to --ram-budget (page cache included) completes instead of being OOM-killed."""

import os
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from invariants import assert_cache_consistent
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
    s = open_model(streaming_moe, n_ctx=64, learn=False, ram_budget=budget)
    cache = s.model.ffn.source.cache
    plan = s.model.ffn.plan
    assert not plan.fits_resident and cache.capacity_bytes <= plan.expert_cache
    c = s.model.new_cache()
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

    open_model(streaming_moe, n_ctx=64, learn=False, ram_budget="2G").close()  # numba kernels compiled + cached here
    evict(streaming_moe)  # start cold: pages cached by the writer were charged to us, not to the capped run
    cmd = [sys.executable, "-m", "cli.main", "run", str(streaming_moe), "-p", "hello there", "-n", "12",
           "--ram-budget", CAP, "-c", "64"]
    env = dict(os.environ, STREAM_RUN_CACHE=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = run_capped(cmd, CAP, timeout=300, env=env)
    assert not res.oom_killed, res.summary()
    assert res.returncode == 0, res.stderr
    assert "experts: hit rate" in res.stderr  # it streamed and reported its traffic
    assert res.max_usage_bytes <= 400 * 2**20


def test_too_small_budget_names_a_budget_that_works(streaming_moe, monkeypatch):
    """The 'needs at least X' figure is exact: X is accepted, a little less is refused."""
    import re

    from streamer.budget import make_plan
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
        make_plan("100M", *args)
    need = float(re.search(r"needs at least ([\d.]+) MiB", str(err.value)).group(1))
    make_plan(int((need + 0.01) * 2**20), *args)  # the printed figure, rounded up to its last digit: accepted
    with pytest.raises(StreamerError):
        make_plan(int((need - 0.5) * 2**20), *args)
