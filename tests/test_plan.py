"""`stream-run plan` and the --plot pictures: predictions per budget from a trace's replay or the uniform bound,
the disk probe cached per device, foreign traces and dense models refused with one line."""

import json

import numpy as np
import pytest
from test_cli import user_error
from test_trace import record, slot_bytes, synthetic_trace
from typer.testing import CliRunner

from streamer.cli.main import app
from streamer.plan import uniform_hit_rate
from streamer.replay import simulate, summarize

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_uniform_bound_matches_a_replayed_uniform_trace(tmp_path):
    """The no-trace hit model (a cache holding share s of the experts hits s of uniform requests) against the
    replay of uniformly random routing through the runtime's LRU cache."""
    rng = np.random.default_rng(3)
    n_layer, n_expert, k = 2, 32, 2
    steps = [np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layer)]) for _ in range(1500)]
    trace = synthetic_trace(tmp_path, steps, n_layer, n_expert, k)
    g = trace.geometry
    for slots in (16, 32, 48):
        got = summarize(simulate(trace, slots, [], 0, "lru", 1.0, False), n_layer)["all"]["hit_rate"]
        want = uniform_hit_rate(slots, g)
        # slots in use by the current layer hold experts that cannot be hit in the same layer call
        assert abs(got - want) <= 0.05 + k / (n_layer * n_expert), (slots, got, want)


def test_plan_with_a_trace_and_without(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    record(path, tmp_path / "t.npz", learn=False, prefetch=True, expert_cache_bytes=10 * slot_bytes(path))
    r = invoke("plan", path, "--trace", tmp_path / "t.npz", "--probe-seconds", "0.2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["hit_model"].startswith("replay of") and out["policy"] == "lru"
    rows = [x for x in out["rows"] if x["policy"] == "lru" and x["state"] != "too small"]
    assert rows and out["recommended"]["budget"] in [x["budget"] for x in rows]
    streamed = [x for x in rows if x["state"] is None]
    resident = [x for x in rows if x["state"] == "resident"]
    assert resident and resident[0]["decode_tok_s"] >= max(x["decode_tok_s"] for x in rows) - 1e-9
    for x in streamed:  # the prediction uses the replay at that budget
        rep = next(y for y in out["replay"]["results"] if y["budget"] == x["budget"] and y["policy"] == "lru")
        assert x["hit_rate"] == rep["decode"]["hit_rate"]
        assert x["read_bytes_per_token"] == rep["decode"]["read_bytes_per_token"]
        assert 0 < x["decode_tok_s"] < 1 / out["decode_step_s"] + 1e-9
    assert out["disk"]["cached"] is None and out["disk"]["throughput_Bps"] > 0
    # the probe is cached per device: the second plan reuses it; uniform bound without a trace
    r2 = invoke("plan", path, "--ram-budget", "1G", "--json")
    assert r2.exit_code == 0, r2.output
    out2 = json.loads(r2.stdout)
    assert out2["disk"]["cached"] and out2["hit_model"] == "uniform routing bound"
    assert [x["budget"] for x in out2["rows"]] == [2**30]
    text = invoke("plan", path, "--trace", tmp_path / "t.npz")
    assert text.exit_code == 0 and "recommended: --ram-budget" in text.stdout and "Belady" in text.stdout


def test_plan_refuses_foreign_traces_dense_models_and_bad_flags(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    record(path, tmp_path / "t.npz", n_decode=2, learn=False, expert_cache_bytes=10 * slot_bytes(path))
    user_error(invoke("plan", synth_model("tiny-moe", "Q4_K"), "--trace", tmp_path / "t.npz"), "trace of another model")
    user_error(invoke("plan", synth_model("tiny", "Q8_0")), "dense model")
    user_error(invoke("plan", path, "--ram-budget", "lots"), "cannot read size")
    user_error(invoke("plan", path, "--probe-seconds", "0"), "probe-seconds")
    user_error(invoke("plan", path, "--trace", tmp_path / "none.npz"), "no such trace file")


def test_plots_are_written(synth_model, tmp_path):
    pytest.importorskip("matplotlib")
    path = synth_model("tiny-moe", "Q8_0")
    sb = slot_bytes(path)
    r = invoke("profile", path, "-n", "4", "--no-learn", "--trace", tmp_path / "t.npz", "--plot", tmp_path / "p.png")
    assert r.exit_code == 0, r.output
    record(path, tmp_path / "s.npz", learn=False, expert_cache_bytes=10 * sb)
    assert invoke("replay", tmp_path / "s.npz", "--plot", tmp_path / "r.png").exit_code == 0
    assert (
        invoke(
            "plan", path, "--trace", tmp_path / "s.npz", "--probe-seconds", "0.2", "--plot", tmp_path / "q.png"
        ).exit_code
        == 0
    )
    for name in ("p.png", "r.png", "q.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_is_one_line(synth_model, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *args, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    user_error(
        invoke("profile", synth_model("tiny-moe", "Q8_0"), "--plot", tmp_path / "p.png"),
        r"pip install 'stream-run\[plot\]'",
    )


def test_recommendation_stays_within_the_memory_available():
    from streamer.plan import recommend

    G = 2**30
    rows = [
        {"budget": b * G, "policy": "uniform", "state": None, "decode_tok_s": v}
        for b, v in ((4, 1.0), (8, 1.5), (24, 2.0))
    ]
    assert recommend(rows, "uniform")["budget"] == 24 * G  # the whole machine's memory, if nothing bounds it
    assert recommend(rows, "uniform", limit=16 * G)["budget"] == 8 * G  # the best of what can be had
    assert recommend(rows, "uniform", limit=2 * G) is None


def test_plan_ladder_shows_the_default_budget(synth_model, monkeypatch):
    from streamer import plan

    G = 2**30
    monkeypatch.setattr(plan, "available_memory", lambda: 64 * G)
    monkeypatch.setattr(plan, "resolve", lambda b: 40 * G)
    path = synth_model("tiny-moe", "Q8_0")
    r = invoke("plan", path, "--probe-seconds", "0.2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    budgets = [x["budget"] for x in out["rows"]]
    assert 40 * G in budgets and max(budgets) == 64 * G  # the ladder ends at the memory available
    assert out["available_memory"] == 64 * G and out["default_budget"] == 40 * G
    text = invoke("plan", path, "--probe-seconds", "0.2")
    assert "<- the default budget" in text.stdout and "available now" in text.stdout
