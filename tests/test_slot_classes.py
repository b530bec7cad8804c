"""Expert cache slots of several sizes (experts/cache.py SlotClasses): a recipe that gives some layers larger
experts (Q4_K_M's Q6_K ffn_down) gets one slot size per kind of layer, so the same bytes hold more experts;
each class evicts only its own; streamed stays bit-identical to resident and the trace replay reproduces the
live run's tiers."""

import numpy as np
import pytest
from forcing import run
from invariants import assert_cache_consistent, loaded

from streamer.experts.cache import ExpertCache, SlotClasses, cache_slots
from streamer.experts.store import ExpertLayout
from streamer.options import StreamOptions
from streamer.session import open_model

SMALL, BIG = 3 * 4096, 4 * 4096


def test_cache_slots_give_each_class_the_same_share_of_its_experts():
    sizes = [SMALL] * 6 + [BIG] * 2  # 8 layers of 16 experts, k = 4
    budget = 40 * SMALL + 5 * BIG + 100  # a third of the experts: 32 of 96 small, 10 of 32 big (by hand)
    n, pins, classes = cache_slots(budget, sizes, 16, 4, 0.5)
    share = budget / (6 * 16 * SMALL + 2 * 16 * BIG)
    assert classes.of_layer == (0,) * 6 + (1,) * 2 and classes.slot_bytes == (SMALL, BIG)
    assert classes.n_slots == (int(share * 96), int(share * 32)) == (32, 10)
    assert n == 42 > budget // BIG == 35  # one size (the largest) for all would hold fewer experts
    assert classes.n_slots[0] * SMALL + classes.n_slots[1] * BIG <= budget
    assert pins == min(int(0.5 * n), n - 8)
    # every layer alike, or a class below two layers' worth of slots: one class of the largest size, as before
    assert cache_slots(budget, [BIG] * 8, 16, 4, 0.5)[2] is None
    n, _, classes = cache_slots(12 * SMALL + 7 * BIG, sizes, 16, 4, 0.5)
    assert classes is None and n == (12 * SMALL + 7 * BIG) // BIG
    # room for everything: every expert of each class
    assert cache_slots(10**9, sizes, 16, 4, 0.5)[2].n_slots == (96, 32)


def test_a_class_evicts_only_its_own_and_its_slots_are_its_own_bytes():
    classes = SlotClasses(of_layer=(0, 0, 1), slot_bytes=(SMALL, BIG), n_slots=(3, 2))
    cache = ExpertCache(5, BIG, reserve=1, classes=classes)
    assert cache.capacity_bytes == cache.arena.nbytes == 3 * SMALL + 2 * BIG
    small = [loaded(cache, (0, e)) for e in range(3)]
    big = [loaded(cache, (2, e)) for e in range(2)]
    spans = sorted(
        (cache.slot_offset(x.slot, x.key[0]), cache.slot_offset(x.slot, x.key[0]) + (BIG if x.key[0] == 2 else SMALL))
        for x in small + big
    )
    assert spans[0][0] == 0 and spans[-1][1] == cache.capacity_bytes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # disjoint, and the whole arena
    for x in small + big:  # each slot's buffer is its own bytes of the arena
        buf = cache.slot_buffer(x.slot, x.key[0])
        assert buf.size == (BIG if x.key[0] == 2 else SMALL)
        buf[:] = x.key[1] + 10 * x.key[0]
    for x in small + big:
        start = cache.slot_offset(x.slot, x.key[0])
        assert (cache.flat[start : start + (BIG if x.key[0] == 2 else SMALL)] == x.key[1] + 10 * x.key[0]).all()
    # a big layer's new expert evicts the least recent big one, never a small one (older as they are)
    loaded(cache, (2, 7))
    assert (2, 0) not in cache.entries and all((0, e) in cache.entries for e in range(3))
    # the reserve holds per class: the small class's idle slots do not let the big class prefetch
    held = [cache.acquire((2, e))[0] for e in (1, 7)]  # both big slots in use
    assert cache.acquire((2, 9), prefetch=True) == (None, False)
    assert cache.acquire((1, 9), prefetch=True)[1]  # the small class has room for it
    for e in held:
        cache.release(e)
    assert cache.evictions == 2
    assert_cache_consistent(cache)


@pytest.fixture
def mixed(synth_model):
    """tiny-moe (4 layers, 16 experts, 4 used) as Q4_K_M: layers 2 and 3 have Q6_K ffn_down (larger experts)."""
    path = synth_model("tiny-moe", "Q8_0", recipe="Q4_K_M")
    s = open_model(path, StreamOptions(stream=False, learn=False))
    layout = ExpertLayout(s.gf, s.cfg)
    assert layout.layer_slot_bytes[0] < layout.layer_slot_bytes[2]
    return path, layout


def test_mixed_recipe_streams_bit_identical_in_classes_and_holds_more(mixed):
    path, layout = mixed
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    for share in (0.3, 0.6):
        nbytes = int(share * layout.total_bytes)
        for prefetch in (False, True):
            s = open_model(path, StreamOptions(learn=False, prefetch=prefetch, expert_cache_bytes=nbytes))
            cache = s.model.ffn.source.cache
            assert cache.classes.slot_bytes == (layout.layer_slot_bytes[0], layout.layer_slot_bytes[2])
            assert cache.n_slots > nbytes // layout.slot_bytes and cache.capacity_bytes <= nbytes
            assert np.array_equal(run(s), resident), (share, prefetch)
            assert cache.evictions > 0 or share > 0.5
            assert_cache_consistent(cache)


@pytest.fixture
def mixed_trace(mixed, tmp_path):
    """(the routing trace of a streamed run of the mixed file with 30% of its expert bytes cached, its layout)."""
    from streamer.trace import load_trace

    path, layout = mixed
    out = tmp_path / "t.npz"
    with open_model(path, StreamOptions(learn=False, expert_cache_bytes=int(0.3 * layout.total_bytes)), trace=out) as s:
        run(s)
    return load_trace(out), layout


def test_mixed_recipe_replay_reproduces_the_live_tiers(mixed_trace):
    from streamer.replay import recorded_classes, simulate

    trace, layout = mixed_trace
    c = trace.header["cache"]
    classes = recorded_classes(c)
    assert classes is not None and trace.geometry["layer_slot_bytes"] == layout.layer_slot_bytes
    o = trace.header["options"]
    sim = simulate(trace, c["n_slots"], [], 0, "lru", o["expert_top_p"], o["prefetch"], classes=classes)
    assert np.array_equal(sim["q_tier"], trace.a["q_tier"])
    one = simulate(trace, c["n_slots"], [], 0, "lru", o["expert_top_p"], o["prefetch"])  # without the classes
    assert not np.array_equal(one["q_tier"], trace.a["q_tier"])  # (the classes change what is evicted)


def test_every_replay_policy_keeps_each_class_within_its_slots(mixed_trace):
    """Each policy's simulated cache evicts within a class; the per-layer policy's quotas split each class's
    slots among its own layers; Belady, the bound, hits at least as often as LRU."""
    from streamer.replay import POLICIES, recorded_classes, simulate, summarize

    trace, _ = mixed_trace
    c = trace.header["cache"]
    classes = recorded_classes(c)
    hits = {}
    for pol in POLICIES:
        sim = simulate(trace, c["n_slots"], [], 0, pol, 1.0, False, classes=classes)
        hits[pol] = summarize(sim, 4)["all"]["hit_rate"]
        if pol == "per-layer":
            q = sim["quotas"]
            for k, n in enumerate(classes.n_slots):
                assert sum(v for v, cl in zip(q, classes.of_layer) if cl == k) == n
    assert hits["belady"] >= hits["lru"]
