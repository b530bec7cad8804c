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
