"""The expert arena's prefault threads (streamer/experts/prefault.py): they fault in the never-used slots (the
kernel's count: the mapping's Rss), leave bytes already read untouched, start at the lowest never-used slot,
stop when asked, and run at SCHED_IDLE (the kernel's record of each thread's policy)."""

import os
import threading

import numpy as np
import pytest
from procfs import rss_bytes

from streamer.buffers import arena_empty
from streamer.experts.prefault import Prefaulter

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/proc/self/smaps") and hasattr(os, "SCHED_IDLE")), reason="Linux only"
)
MIB = 2**20


def rss(arena) -> int:
    return rss_bytes(arena.ctypes.data)


def test_prefault_fills_the_arena_at_idle_priority_and_keeps_what_was_read():
    arena = arena_empty(24 * MIB)
    base = rss(arena)  # (a few pages of a neighbouring mapping may share the VMA)
    data = np.random.default_rng(0).integers(0, 256, 3 * MIB + 4096, dtype=np.uint8)
    arena[: data.size] = data  # a slot read before the thread passes over it
    assert rss(arena) - base < 4 * MIB
    gate, asked = threading.Event(), threading.Event()
    policies = {}  # each asking thread's scheduling policy, as the kernel has it

    def todo():  # the never-used slots: held until the test has looked at the thread
        policies[threading.get_native_id()] = os.sched_getscheduler(0)
        asked.set()
        gate.wait()
        return [(0, arena.size)]

    p = Prefaulter(arena, todo).start()
    assert asked.wait(5)
    gate.set()
    assert p.done.wait(30) and p.error == 0
    assert len(p.threads) == 2 and set(policies) == {t.native_id for t in p.threads}  # both asked for work
    assert set(policies.values()) == {os.SCHED_IDLE}
    assert rss(arena) - base >= arena.size - 4096
    assert np.array_equal(arena[: data.size], data)


def test_prefault_starts_at_the_lowest_never_used_slot_and_stops_when_asked():
    arena = arena_empty(32 * MIB)
    base = rss(arena)
    p = Prefaulter(arena, lambda: [(16 * MIB, arena.size)]).start()  # the first half is the cache's own: not touched
    assert p.done.wait(30) and p.error == 0
    assert arena.size // 2 - 4096 <= rss(arena) - base <= arena.size // 2 + 8192
    small, gate = arena_empty(16 * MIB), threading.Event()
    base = rss(small)
    stopped = Prefaulter(small, lambda: gate.wait() and [(0, small.size)]).start()
    stopped.stop()  # while it waits for its first chunk: that chunk at most, then it stops
    gate.set()
    assert stopped.done.wait(30) and rss(small) - base <= 2 * MIB + 8192


def test_a_prefaulter_never_started_touches_nothing_and_stops_at_once():
    arena = arena_empty(8 * MIB)
    base = rss(arena)
    p = Prefaulter(arena, lambda: [(0, arena.size)])
    assert not p.thread.is_alive() and not p.done.is_set()
    p.stop()
    assert p.done.is_set() and rss(arena) - base <= 8192
    p.start()  # after stop(): it does not start
    assert not p.thread.is_alive() and rss(arena) - base <= 8192


def test_the_streamed_cache_prefaults_after_the_first_layer_and_its_session_stops_it(synth_model, monkeypatch):
    """A streamed session's cache has the thread over its arena; the MoE layer starts it once the first forward's
    first layer has run (not during start-up, whose kernel loading it slowed), and closing the session stops it."""
    from streamer.options import StreamOptions
    from streamer.session import open_model

    stopped = []
    real_stop = Prefaulter.stop
    monkeypatch.setattr(Prefaulter, "stop", lambda self: (stopped.append(self), real_stop(self)))
    path = synth_model("tiny-moe", "Q8_0")
    with open_model(path, StreamOptions(learn=False, expert_cache_bytes=40 << 20)) as s:
        cache = s.model.ffn.source.cache
        assert cache.prefaulter is not None and cache.prefaulter.arena().ctypes.data == cache.arena.ctypes.data
        assert not cache.prefaulter.thread.is_alive() and not cache.prefaulter.done.is_set()  # not yet started
        layers = []
        real_call = type(s.model.ffn).__call__

        def call(ffn, layer, h):  # the thread's state as each layer call begins
            layers.append((layer, cache.prefaulter.started))
            return real_call(ffn, layer, h)

        monkeypatch.setattr(type(s.model.ffn), "__call__", call)
        s.model.forward(np.array([3, 77, 120], np.int64), s.model.new_state())
        assert layers[0] == (0, False) and all(started for _, started in layers[2:])
        assert cache.prefaulter.thread.ident is not None and not stopped
    assert stopped == [cache.prefaulter] and cache.prefaulter.done.wait(30)


def test_the_cache_grows_only_as_far_as_the_threads_have_faulted_in():
    """The threads fault in every slot class's never-used slots. ExpertCache.ready(), per class: the never-used
    slots they have faulted in; none before they start, every one once they have ended (the arena's Rss says they are in), None once they stopped on an
    error (nothing holds growth back then). A decode acquire holds to it (tests/test_moe.py)."""
    from invariants import loaded

    from streamer.experts.cache import ExpertCache, SlotClasses

    classes = SlotClasses((0, 1), (MIB, 3 * MIB), (8, 4))  # layer 0: 8 slots of 1 MiB, layer 1: 4 of 3 MiB
    cache = ExpertCache(12, 3 * MIB, classes=classes)
    base = rss(cache.arena)
    assert cache.ready() == [0, 0]
    loaded(cache, (0, 5))  # a slot of class 0 used before the threads start
    assert cache.untouched() == [(MIB, 8 * MIB), (8 * MIB, 20 * MIB)]  # each class's never-used slots
    cache.prefaulter.start()
    assert cache.prefaulter.done.wait(30) and cache.prefaulter.error == 0
    assert cache.ready() == [7, 4] == cache.fresh
    assert rss(cache.arena) - base >= cache.arena.nbytes - MIB - 4096  # all but the slot taken (never written)
    loaded(cache, (1, 0))
    assert cache.ready() == [7, 3]
    cache.prefaulter.error = 12  # ENOMEM
    assert cache.ready() is None


def test_a_run_held_to_its_allowances_keeps_its_logits_and_replays_exactly(synth_model, tmp_path, monkeypatch):
    """A streamed run whose decode steps may grow the cache by a slot in one layer call of six (a schedule standing
    in for the threads' pace) reads more than one that grows freely, gives the resident run's logits bit for
    bit, records the allowances, and `replay` of its trace serves every request as the run did."""
    import itertools

    from streamer.experts.cache import ExpertCache
    from streamer.experts.store import ExpertLayout
    from streamer.options import StreamOptions
    from streamer.replay import recorded_classes, simulate
    from streamer.session import open_model
    from streamer.trace import load_trace

    path = synth_model("tiny-moe", "Q8_0")
    prompt = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], np.int64)

    def run(options, trace=None):
        with open_model(path, options, trace=trace) as s:
            c = s.model.new_state()
            out = [s.model.forward(prompt[:5], c)[-1]]
            for i in range(14):
                out.append(s.model.forward(prompt[5 + i % 7 : 6 + i % 7] * (i + 1) % 250, c)[-1])
            return np.array(out), s.traffic.totals(), getattr(s.model.ffn.source, "cache", None)

    resident, _, _ = run(StreamOptions(stream=False, learn=False))
    with open_model(path, StreamOptions(stream=False, learn=False)) as s:
        sb = ExpertLayout(s.gf, s.cfg).slot_bytes
    options = StreamOptions(learn=False, prefetch=True, expert_cache_bytes=30 * sb)
    monkeypatch.setattr(ExpertCache, "ready", lambda self: None)
    _, free, free_cache = run(options)
    ticks = itertools.count()
    monkeypatch.setattr(ExpertCache, "ready", lambda self: [int(next(ticks) % 6 == 0)] * len(self.frees))
    held, live, cache = run(options, tmp_path / "t.npz")
    assert np.array_equal(held, resident)
    assert cache.touched_slots < free_cache.touched_slots and live.read_bytes > free.read_bytes
    trace = load_trace(tmp_path / "t.npz")
    a = trace.a
    assert len(a["a_call"]) > 0 and set(a["a_slots"].tolist()) == {0, 1}
    c = trace.header["cache"]
    sim = simulate(trace, c["n_slots"], [], c["pin_capacity"], "lru", 1.0, True, classes=recorded_classes(c))
    assert np.array_equal(sim["q_expert"], a["q_expert"]) and np.array_equal(sim["q_tier"], a["q_tier"])
    assert np.array_equal(sim["p_expert"], a["p_expert"]) and np.array_equal(sim["a_slots"], a["a_slots"])
    # a cache that never evicts is never held back, as in a live run: Belady's, or one with a slot for every expert
    for n_slots, policy in ((c["n_slots"], "belady"), (64, "lru")):
        assert len(simulate(trace, n_slots, [], 0, policy, 1.0, False)["a_call"]) == 0
