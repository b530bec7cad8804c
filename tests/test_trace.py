"""Routing traces and `stream-run replay`: a replay of a run's own trace at that run's cache reproduces what the
live run's traffic counted (every request's tier, every byte); Belady is never beaten by an online policy;
malformed, truncated, future-version and foreign traces are one error line."""

import json
import zipfile

import numpy as np
import pytest
from test_cli import user_error
from typer.testing import CliRunner

from streamer.cli.main import app
from streamer.experts.store import ExpertLayout
from streamer.options import StreamOptions
from streamer.replay import POLICIES, ReplayOptions, recorded_classes, replay, simulate, slots_at, summarize
from streamer.session import open_model
from streamer.trace import ARRAYS, FORMAT, VERSION, load_trace, save_trace

runner = CliRunner()
PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], dtype=np.int64)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def slot_bytes(path):
    with open_model(path, StreamOptions(stream=False, learn=False)) as s:
        return ExpertLayout(s.gf, s.cfg).slot_bytes


def record(path, out, n_decode=16, n_ctx=None, n_prompt=5, **kw):
    """Prefill n_prompt tokens, decode n_decode (inputs fixed, so routing is too); the live traffic's totals."""
    with open_model(path, StreamOptions(**kw), n_ctx=n_ctx, trace=out) as s:
        c = s.model.new_state()
        s.model.forward(PROMPT[:n_prompt], c)
        for i in range(n_decode):
            s.model.forward(PROMPT[5 + i % 7 : 6 + i % 7] * (i + 1) % 250, c)
        totals = s.traffic.totals()
    return totals, load_trace(out)


def replay_recorded(trace):
    c = trace.header["cache"]
    pol = "pinned-lru" if c["pins"] else "lru"
    return simulate(
        trace,
        c["n_slots"],
        [tuple(p) for p in c["pins"]],
        c["pin_capacity"],
        pol,
        trace.header["options"]["expert_top_p"],
        trace.header["options"]["prefetch"],
        classes=recorded_classes(c),
    )


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("slots,n_prompt", [(4, 5), (7, 5), (12, 5), (30, 5), (30, 1)])
def test_replay_of_own_trace_reproduces_the_live_run_exactly(synth_model, tmp_path, slots, n_prompt, prefetch):
    """(A prompt of one token is the first forward: it reuses cache slots as a longer prompt does.)"""
    path = synth_model("tiny-moe", "Q8_0")
    live, trace = record(
        path,
        tmp_path / "t.npz",
        n_prompt=n_prompt,
        learn=False,
        prefetch=prefetch,
        expert_cache_bytes=slots * slot_bytes(path),
    )
    a = trace.a
    # the trace agrees with the traffic's own counts
    assert len(a["q_tier"]) == live.requests
    assert np.bincount(a["q_tier"], minlength=4).tolist() == [
        live.hit_pinned,
        live.hit_lru,
        live.hit_prefetched,
        live.miss,
    ]
    assert a["q_bytes"].sum() == live.read_bytes and a["p_bytes"].sum() == live.prefetch_bytes
    assert len(a["p_call"]) == live.prefetch_issued and (a["r_wp"] > 0).sum() == live.routed
    sim = replay_recorded(trace)
    # request by request, the same experts served the same way, the same prefetches issued
    assert np.array_equal(sim["q_expert"], a["q_expert"]) and np.array_equal(sim["q_call"], a["q_call"])
    assert np.array_equal(sim["q_tier"], a["q_tier"]), (slots, prefetch)
    assert np.array_equal(sim["p_expert"], a["p_expert"]) and np.array_equal(sim["p_call"], a["p_call"])
    assert sim["q_bytes"].sum() + sim["p_bytes"].sum() == live.read_bytes + live.prefetch_bytes
    if prefetch and slots > 8:
        assert live.prefetch_issued > 0


def test_expert_top_p_run_replays_exactly(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    live, trace = record(
        path, tmp_path / "t.npz", learn=False, prefetch=True, expert_top_p=0.7, expert_cache_bytes=12 * slot_bytes(path)
    )
    assert live.dropped > 0 and (trace.a["r_wp"] == 0).sum() == live.dropped
    sim = replay_recorded(trace)
    assert np.array_equal(sim["q_tier"], trace.a["q_tier"]) and np.array_equal(sim["q_expert"], trace.a["q_expert"])
    assert np.array_equal(sim["p_expert"], trace.a["p_expert"])


def test_pinned_run_replays_exactly_and_replans_budgets_like_the_runtime(synth_model, tmp_path):
    import psutil

    from streamer.budget import scratch_bytes
    from streamer.config import ModelConfig
    from streamer.gguf_file import GGUFFile

    path = synth_model("tiny-moe", "Q8_0")
    sb = slot_bytes(path)
    record(path, tmp_path / "a.npz", learn=True, expert_cache_bytes=12 * sb)  # writes the usage profile
    usage = next((tmp_path / "cache" / "usage").glob("*.json"))
    doc = json.loads(usage.read_text())
    doc["counts"][2][5] = doc["counts"][1][3] = 1000.0  # two experts learned hot
    usage.write_text(json.dumps(doc))
    # a real --ram-budget whose expert cache holds about 30 of the 64 experts
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    kv = cfg.kv_bytes_per_token * cfg.context(64)
    rest = psutil.Process().memory_info().rss + nonexpert + kv + scratch_bytes(cfg)
    budget = int((rest + 64 * 2**20 + 30 * sb) * 32 / 31)
    live, trace = record(path, tmp_path / "b.npz", learn=True, ram_budget=budget, n_ctx=64)
    c = trace.header["cache"]
    assert trace.header["plan"]["budget"] == budget and [2, 5] in c["pins"] and [1, 3] in c["pins"]
    assert slots_at(trace.header["plan"], trace.geometry, budget) == (
        c["n_slots"],
        c["pin_capacity"],
        None,
        recorded_classes(c),
    )
    sim = replay_recorded(trace)
    assert np.array_equal(sim["q_tier"], trace.a["q_tier"])
    assert (trace.a["q_tier"] == 0).sum() == live.hit_pinned > 0
    # the CLI at the recorded budget: live and replayed figures agree, at the budget as at the recorded cache
    r = invoke("replay", tmp_path / "b.npz", "--budget", str(budget), "--policy", "pinned-lru,belady", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["recorded"]["policy"] == "pinned-lru"
    row = out["results"][0]
    assert row["n_slots"] == c["n_slots"]
    for scope in ("all", "decode"):
        assert row[scope]["hit_rate"] == out["live"][scope]["hit_rate"]
        assert row[scope]["read_bytes"] == out["live"][scope]["read_bytes"]
        assert out["results"][1][scope]["hit_rate"] >= row[scope]["hit_rate"]


# ---- Belady is the ceiling ----


def synthetic_trace(tmp_path, steps, n_layer=3, n_expert=16, k=2, prefill=None, name="syn.npz"):
    """A trace from routing alone: steps is a list of (n_layer, k) expert-id arrays (decode steps), prefill an
    optional (m, n_layer, k) first step. The lookahead predicts each layer's true experts with one mistake."""
    rng = np.random.default_rng(1)
    calls, rows, look = [], [], []
    all_steps = ([] if prefill is None else [prefill]) + [s[None] for s in steps]
    for st, toks in enumerate(all_steps):
        for layer in range(n_layer):
            calls.append((st, layer, len(toks), 0))
            rows.append(toks[:, layer])
            if len(toks) == 1 and layer >= 1:
                guess = toks[0, layer].copy()
                guess[-1] = rng.integers(n_expert)
                if len(set(guess.tolist())) == k:
                    look.append((st, layer, guess))
    c = np.array(calls)
    ids = np.concatenate(rows).astype(np.int16)
    w = np.sort(rng.random(ids.shape).astype(np.float32), axis=1)[:, ::-1].copy()
    w /= w.sum(axis=1, keepdims=True)
    lk = np.array([x[2] for x in look], np.int16).reshape(-1, k)
    a = {
        "c_step": c[:, 0],
        "c_layer": c[:, 1],
        "c_m": c[:, 2],
        "c_seg": c[:, 3],
        "r_ids": ids,
        "r_w": w,
        "r_wp": w,
        "l_step": np.array([x[0] for x in look]),
        "l_layer": np.array([x[1] for x in look]),
        "l_ids": lk,
        "l_w": np.full(lk.shape, 1 / k, np.float32),
    }
    for n in ARRAYS:
        if n not in a:
            a[n] = np.zeros(0)
    a = {n: np.asarray(a[n]).astype(dt) for n, (dt, _) in ARRAYS.items()}
    eb = [1000] * n_layer
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"file": "synthetic", "size": 1, "key": "x"},
        "geometry": {
            "n_layer": n_layer,
            "n_expert": n_expert,
            "n_expert_used": k,
            "expert_bytes": eb,
            "slot_bytes": 4096,
            "fused": [True] * n_layer,
        },
        "plan": {
            "budget": None,
            "baseline": 0,
            "nonexpert": 0,
            "kv": 0,
            "scratch": 0,
            "expert_total": 1000 * n_layer * n_expert,
            "slot_bytes": 4096,
        },
        "cache": {"n_slots": 2 * k, "pin_capacity": 0, "reserve": k, "pins": []},
        "options": {"expert_top_p": 1.0, "prefetch": True, "stream": True, "pin_share": 0.5, "window": k},
        "usage_saved": False,
    }
    save_trace(tmp_path / name, header, a)
    return load_trace(tmp_path / name)


def skewed_steps(rng, n, n_layer, n_expert, k):
    p = rng.dirichlet(np.full(n_expert, 0.3), size=n_layer)
    return [
        np.stack([rng.choice(n_expert, k, replace=False, p=p[layer]) for layer in range(n_layer)]) for _ in range(n)
    ]


def traces_for_belady(tmp_path, synth_model):
    rng = np.random.default_rng(7)
    n_layer, n_expert, k = 3, 16, 2
    uniform = [np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layer)]) for _ in range(60)]
    skewed = skewed_steps(rng, 60, n_layer, n_expert, k)
    # adversarial for LRU: a cycle over a few more experts than the cache holds
    cycle = [np.array([[(2 * i) % 14, (2 * i + 1) % 14]] * n_layer) for i in range(60)]
    # adversarial for LFU: experts hot early go cold, the new hot set is never counted up in time
    shift = [
        np.array([[0, 1]] * n_layer) if i < 20 else np.array([[2 + (i % 6) * 2, 3 + (i % 6) * 2]] * n_layer)
        for i in range(60)
    ]
    prefill = np.stack([rng.choice(n_expert, (n_layer, k)) for _ in range(6)])
    prefill = np.stack([[rng.choice(n_expert, k, replace=False) for _ in range(n_layer)] for _ in range(6)])
    out = [
        synthetic_trace(tmp_path, s, n_layer, n_expert, k, pf, name=f"{i}.npz")
        for i, (s, pf) in enumerate([(uniform, None), (skewed, prefill), (cycle, None), (shift, prefill)])
    ]
    path = synth_model("tiny-moe", "Q8_0")
    _, live = record(path, tmp_path / "live.npz", learn=False, prefetch=True, expert_cache_bytes=10 * slot_bytes(path))
    return out + [live]


def test_belady_is_never_beaten(synth_model, tmp_path):
    for trace in traces_for_belady(tmp_path, synth_model):
        g = trace.geometry
        n_layer = g["n_layer"]
        for slots in (g["n_expert_used"], g["n_expert_used"] + 3, 12, 20, 40):
            for prefetch in (False, True):
                best = summarize(simulate(trace, slots, [], 0, "belady", 1.0, False), n_layer)["all"]
                for pol in ("lru", "lfu", "pinned-lru", "per-layer"):
                    from streamer.experts.usage import choose_pins
                    from streamer.replay import routed, usage_counts

                    pins = choose_pins(usage_counts(trace, routed(trace, 1.0)), max(slots - 2 * g["n_expert_used"], 0))
                    got = summarize(simulate(trace, slots, pins, len(pins), pol, 1.0, prefetch), n_layer)["all"]
                    assert best["hit_rate"] >= got["hit_rate"], (trace.path.name, slots, pol, prefetch)
    # and the adversarial cycle really is one: LRU hits nothing where Belady hits plenty
    cyc = load_trace(tmp_path / "2.npz")
    lru = summarize(simulate(cyc, 12, [], 0, "lru", 1.0, False), 3)["all"]["hit_rate"]
    opt = summarize(simulate(cyc, 12, [], 0, "belady", 1.0, False), 3)["all"]["hit_rate"]
    assert lru == 0.0 and opt > 0.2


def test_replay_cli_table_and_top_p(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    record(path, tmp_path / "t.npz", learn=False, prefetch=True, expert_cache_bytes=10 * slot_bytes(path))
    r = invoke("replay", tmp_path / "t.npz", "--per-layer")
    assert r.exit_code == 0, r.output
    assert "live vs replay" in r.stdout and "belady" in r.stdout and "per layer" in r.stdout
    full = replay(load_trace(tmp_path / "t.npz"), ReplayOptions(policies=("lru",)))
    half = replay(load_trace(tmp_path / "t.npz"), ReplayOptions(policies=("lru",), expert_top_p=0.5))
    assert half["results"][0]["all"]["requests"] < full["results"][0]["all"]["requests"]
    assert set(POLICIES) == {"lru", "lfu", "pinned-lru", "belady", "per-layer"}


# ---- bad traces ----


def test_bad_traces_are_one_error_line(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    good = tmp_path / "t.npz"
    record(path, good, n_decode=3, learn=False, expert_cache_bytes=10 * slot_bytes(path))
    raw = good.read_bytes()

    def variant(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return p

    user_error(invoke("replay", tmp_path / "missing.npz"), "no such trace file")
    user_error(invoke("replay", variant("junk.npz", b"not a zip at all" * 10)), "corrupt or truncated")
    user_error(invoke("replay", variant("half.npz", raw[: len(raw) // 2])), "corrupt or truncated")
    user_error(invoke("replay", variant("tail.npz", raw[:-40])), "corrupt or truncated")

    def rewritten(name, edit_header=None, edit_arrays=None):
        with np.load(good) as z:
            arrays = {n: z[n] for n in z.files if n != "header"}
            header = json.loads(z["header"].tobytes())
        if edit_header:
            edit_header(header)
        if edit_arrays:
            edit_arrays(arrays)
        save_trace(tmp_path / name, header, arrays)
        return tmp_path / name

    user_error(invoke("replay", rewritten("future.npz", lambda h: h.update(version=VERSION + 1))), "newer stream-run")
    user_error(
        invoke("replay", rewritten("other.npz", lambda h: h.update(format="something-else"))), "not a stream-run trace"
    )
    user_error(
        invoke("replay", rewritten("ids.npz", None, lambda a: a["r_ids"].__setitem__((0, 0), 99))), "inconsistent"
    )
    user_error(invoke("replay", rewritten("gone.npz", None, lambda a: a.pop("q_tier"))), "missing arrays q_tier")
    user_error(invoke("replay", rewritten("noa.npz", None, lambda a: a.pop("a_call"))), "missing arrays a_call")

    def version_1(a):  # written before the allowances: none recorded
        for n in ("a_call", "a_class", "a_slots"):
            a.pop(n)

    old = rewritten("v1.npz", lambda h: h.update(version=1), version_1)
    assert len(load_trace(old).a["a_slots"]) == 0 and invoke("replay", old).exit_code == 0
    negative = {"a_call": np.array([0], "i4"), "a_class": np.array([0], "i2"), "a_slots": np.array([-1], "i4")}
    bad = rewritten("allow.npz", None, lambda a: a.update(negative))
    user_error(invoke("replay", bad), "inconsistent")
    user_error(
        invoke("replay", rewritten("short.npz", None, lambda a: a.update(q_tier=a["q_tier"][:-1]))), "inconsistent"
    )
    # a flipped byte inside a compressed member: the zip's CRC catches it
    with zipfile.ZipFile(good) as z:
        info = z.getinfo("r_w.npy")
    flipped = bytearray(raw)
    local_extra = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    flipped[info.header_offset + 30 + len(info.filename) + local_extra + info.compress_size // 2] ^= 0xFF
    user_error(invoke("replay", variant("flip.npz", bytes(flipped))), "corrupt or truncated")
    user_error(invoke("replay", good, "--policy", "fifo"), "unknown policy")
    user_error(invoke("replay", good, "--budget", "12X"), "cannot read size")


def test_trace_flag_errors_before_any_work(synth_model, tmp_path):
    user_error(
        invoke("run", synth_model("tiny-moe", "Q8_0"), "-p", "hi", "-n", "1", "--trace", tmp_path / "nope" / "t.npz"),
        "no such directory",
    )
    user_error(
        invoke("run", synth_model("tiny", "Q8_0"), "-p", "hi", "-n", "1", "--trace", tmp_path / "t.npz"), "dense model"
    )


def test_trace_from_every_command(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    for cmd, extra in (
        ("run", ["-p", "hello", "-n", "3"]),
        ("profile", ["-n", "3"]),
        ("bench", ["--pp", "4", "--tg", "3"]),
    ):
        out = tmp_path / f"{cmd}.npz"
        r = invoke(cmd, path, *extra, "--trace", out)
        assert r.exit_code == 0, r.output
        t = load_trace(out)
        assert t.n_calls > 0 and t.header["model"]["file"] == path.name
    r = runner.invoke(app, ["chat", str(path), "-n", "3", "--trace", str(tmp_path / "chat.npz")], input="hi\n")
    assert r.exit_code == 0, r.output
    assert load_trace(tmp_path / "chat.npz").n_calls > 0
    bench = load_trace(tmp_path / "bench.npz")
    assert bench.a["c_seg"].max() == 2  # warm-up, prefill, decode


# ---- per-layer slot quotas ----


def heterogeneous_trace(tmp_path, n_steps=400):
    """Layers from very skewed (a few hot experts) to uniform routing."""
    rng = np.random.default_rng(5)
    n_layer, n_expert, k = 6, 32, 4
    p = [rng.dirichlet(np.full(n_expert, a)) for a in (0.05, 0.1, 0.2, 1, 5, 100)]
    steps = [
        np.stack([rng.choice(n_expert, k, replace=False, p=p[layer]) for layer in range(n_layer)])
        for _ in range(n_steps)
    ]
    return synthetic_trace(tmp_path, steps, n_layer, n_expert, k, name="het.npz")


def test_miss_curves_match_an_lru_per_layer(tmp_path):
    from collections import OrderedDict

    from streamer.replay import miss_curves, routed

    trace = heterogeneous_trace(tmp_path, 150)
    routes = routed(trace, 1.0)
    curves = miss_curves(trace, routes)
    for layer in range(trace.geometry["n_layer"]):
        seq = [e for lay, (ids, _) in zip(trace.a["c_layer"], routes) if lay == layer for e in sorted(set(ids[0]))]
        for c in (1, 3, 4, 9, 20, 32):
            lru, misses = OrderedDict(), 0
            for e in seq:
                if e in lru:
                    lru.move_to_end(e)
                else:
                    misses += 1
                    lru[e] = True
                    if len(lru) > c:
                        lru.popitem(last=False)
            assert curves[layer, c] == misses, (layer, c)


def test_layer_quotas_evict_from_the_layer_over_its_quota():
    from streamer.experts.cache import ExpertCache

    def fill(cache, keys):
        for key in keys:
            e, created = cache.acquire(key)
            assert created
            e.future = type("Done", (), {"done": lambda self: True})()
            cache.loaded(e)
            cache.release(e)

    cache = ExpertCache(6, 4096, quotas=[2, 4], allocate=False)
    fill(cache, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)])  # layer 0 is 2 over its quota
    fill(cache, [(1, 2)])
    assert (0, 0) not in cache.entries and (1, 0) in cache.entries  # layer 0's least recent went
    fill(cache, [(1, 3)])
    assert (0, 1) not in cache.entries and cache.held == [2, 4]
    fill(cache, [(1, 4)])  # both at quota: the requesting layer gives up its own least recent
    assert (1, 0) not in cache.entries and cache.held == [2, 4]
    fill(cache, [(0, 9)])
    assert (0, 2) not in cache.entries and cache.held == [2, 4]
    assert sorted(k for k in cache.idle) == sorted(cache.entries)


def test_per_layer_allocation_on_heterogeneous_routing(tmp_path):
    """Measured on synthetic routing (no trained model's trace yet): at a small cache the per-layer quotas
    win clearly over one shared LRU; Belady stays above both."""
    from streamer.replay import allocate, miss_curves, routed

    trace = heterogeneous_trace(tmp_path)
    quotas = allocate(miss_curves(trace, routed(trace, 1.0)), 36, [1] * 6, 4)
    assert sum(quotas) == 36 and min(quotas) >= 4 and quotas[-1] == 4  # the uniform layer gets the floor
    hit = {
        pol: summarize(simulate(trace, 36, [], 0, pol, 1.0, False), 6)["all"]["hit_rate"]
        for pol in ("lru", "per-layer", "belady")
    }
    assert hit["per-layer"] >= hit["lru"] + 0.05 and hit["belady"] >= hit["per-layer"]
