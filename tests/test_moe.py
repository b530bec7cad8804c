"""Qwen3-MoE: logits against the float64 reference, streamed == resident bit for bit across cache sizes,
prefetch and pinning, expert top-p, and the learned-pinning sidecar."""

import json
import os
from concurrent.futures import Future

import numpy as np
import pytest
from invariants import assert_cache_consistent, loaded
from procfs import rss_bytes, vma_fields
from reference import Reference

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.moe import route
from streamer.options import StreamOptions
from streamer.session import open_model

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], dtype=np.int64)
N_PREFILL = 5  # then one token at a time (decode path, with lookahead prefetch)


def cosines(a, b):
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def run(session, tokens=PROMPT, n_prefill=N_PREFILL):
    """Prefill n_prefill tokens, then decode the rest one by one; all-position logits."""
    c = session.model.new_state()
    out = [session.model.forward(tokens[:n_prefill], c, all_logits=True)]
    out += [session.model.forward(tokens[i : i + 1], c, all_logits=True) for i in range(n_prefill, len(tokens))]
    return np.concatenate(out)


def slot_bytes(path):
    s = open_model(path, StreamOptions(stream=False, learn=False))
    return ExpertLayout(s.gf, s.cfg).slot_bytes


# Same float32 arithmetic argument as the dense test; routing in float32 vs float64 could flip a near-tie,
# which the synthetic router's gain (logit std 3) makes unlikely on these 12 tokens x 4 layers.
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_moe_logits_match_float64_reference(synth_model, qtype):
    path = synth_model("tiny-moe", qtype)
    got = run(open_model(path, StreamOptions(stream=False, learn=False)))
    want = Reference(str(path)).logits(PROMPT)
    assert cosines(got, want).min() >= 0.999
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_streamed_is_bit_identical_to_resident(synth_model, qtype):
    path = synth_model("tiny-moe", qtype)
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    sb = slot_bytes(path)
    n_used, everything = 4, 4 * 16
    for slots in (n_used, n_used + 3, 24, everything):
        for prefetch in (False, True):
            s = open_model(path, StreamOptions(learn=False, prefetch=prefetch, expert_cache_bytes=slots * sb))
            got = run(s)
            cache = s.model.ffn.source.cache
            assert np.array_equal(got, resident), (slots, prefetch)
            assert cache.n_slots == slots
            assert_cache_consistent(cache)
            rep = s.model.ffn.traffic.report()
            if prefetch and slots > 2 * n_used:
                assert rep["totals"]["prefetch_issued"] > 0 and rep["prefetch_recall"] is not None
            if slots == everything:  # nothing is ever read twice
                t = rep["totals"]
                assert t["miss"] + t["prefetch_issued"] == len(s.model.ffn.source.cache.entries)


def test_pinning_keeps_hot_experts_and_stays_identical(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    sb = slot_bytes(path)
    first = open_model(path, StreamOptions(learn=True, expert_cache_bytes=12 * sb))
    run(first)
    first.model.ffn.close()  # saves the usage sidecar
    usage = first.model.ffn.usage
    # make layer 2 / expert 5 look very hot in the saved profile
    doc = json.loads(usage.path.read_text())
    doc["counts"][2][5] = 1000.0
    usage.path.write_text(json.dumps(doc))
    second = open_model(path, StreamOptions(learn=True, expert_cache_bytes=12 * sb))
    cache = second.model.ffn.source.cache
    assert (2, 5) in cache.pin_set
    assert np.array_equal(run(second), resident)
    e = cache.entries.get((2, 5))
    if e is not None:  # it was routed: it must have gone to the pinned tier and stayed
        assert e.pinned and (2, 5) not in cache.idle


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding address addr."""
    (vma,) = vma_fields(addr)
    return vma["VmFlags"].split()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_the_arena_is_page_aligned_in_small_pages():
    """O_DIRECT reads land in the arena (4 KiB alignment), and its mapping is private (no "sh" flag: not
    tmpfs pages, whose faults and teardown were slower) and advised MADV_NOHUGEPAGE (the kernel's "nh" flag): a
    2 MiB page's first fault ran 2-8x slower than 4 KiB faults on a VM that lent its free memory back
    (buffers.arena_empty)."""
    from streamer.experts.cache import ExpertCache

    cache = ExpertCache(n_slots=24, slot_bytes=3 * 2**20)
    assert cache.arena.shape == (24 * 3 * 2**20,) and cache.arena.ctypes.data % 4096 == 0
    cache.arena[::4096] = 7  # writable, every page
    assert int(cache.flat[::4096].sum()) == 7 * 24 * 3 * 2**20 // 4096 and not cache.flat.flags.writeable
    for addr in (cache.arena.ctypes.data, cache.arena.ctypes.data + cache.arena.nbytes - 1):
        flags = _vm_flags(addr)
        assert "nh" in flags and "sh" not in flags, flags


def test_an_arena_too_large_to_map_is_a_memory_error():
    """The CLI turns MemoryError into one line that suggests a smaller budget (np.empty raised it; mmap's
    ENOMEM would have been a bare OSError)."""
    from streamer.buffers import arena_empty

    with pytest.raises(MemoryError, match="expert cache"):
        arena_empty(1 << 62)


def test_flat_histogram_pins_nothing():
    from streamer.experts.usage import choose_pins

    rng = np.random.default_rng(0)
    flat = rng.poisson(50, size=(4, 16)).astype(float)
    assert choose_pins(flat, 100) == []
    skewed = flat.copy()
    skewed[1, 3] = 400
    skewed[3, 0] = 300
    assert choose_pins(skewed, 100) == [(1, 3), (3, 0)]
    assert choose_pins(skewed, 1) == [(1, 3)]


def test_usage_sidecar_round_trip_and_corrupt_or_foreign_is_ignored(synth_model, capsys):
    from streamer.experts.usage import Usage
    from streamer.gguf_file import GGUFFile

    gf = GGUFFile(synth_model("tiny-moe", "Q8_0"))
    u = Usage(gf, 4, 16)
    u.record(1, [3, 3, 7])
    u.save()
    again = Usage(gf, 4, 16)
    assert again.saved[1, 3] == 2 and again.saved[1, 7] == 1 and again.saved.sum() == 3
    again.record(1, [3])
    again.save()
    assert Usage(gf, 4, 16).saved[1, 3] == 3  # counts accumulate across runs

    u.path.write_text("{not json")
    assert Usage(gf, 4, 16).saved is None
    assert "ignoring unreadable expert-usage file" in capsys.readouterr().err
    u.path.write_text(json.dumps({"format": "stream-run-usage/1", "model": "someone-else", "counts": [[0] * 16] * 4}))
    assert Usage(gf, 4, 16).saved is None
    assert "another model" in capsys.readouterr().err
    u.path.write_text(json.dumps({"format": "stream-run-usage/1", "model": u.key, "counts": [[1] * 3]}))
    assert Usage(gf, 4, 16).saved is None  # wrong shape
    assert not Usage(gf, 4, 16, learn=False).learn


def test_route_top_p_rule_by_hand():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], dtype=np.float32))
    ids, w = route(logits, 4)  # top-4 of 5, renormalised over 0.95
    assert ids.tolist() == [[0, 1, 2, 3]]
    np.testing.assert_allclose(w, [[0.5 / 0.95, 0.2 / 0.95, 0.15 / 0.95, 0.1 / 0.95]], rtol=1e-6)
    ids, w = route(logits, 4, top_p=0.7)  # cumulative 0.526, 0.737 -> keep 2, rescale to total 1
    assert ids.tolist() == [[0, 1, -1, -1]]
    np.testing.assert_allclose(w, [[0.5 / 0.7, 0.2 / 0.7, 0, 0]], rtol=1e-6)
    ids, w = route(logits, 4, top_p=0.5)
    assert ids.tolist() == [[0, -1, -1, -1]] and w[0, 0] == pytest.approx(1.0)


def test_expert_top_p_one_is_no_pruning(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    base = open_model(path, StreamOptions(stream=False, learn=False))
    p1 = open_model(path, StreamOptions(stream=False, learn=False, expert_top_p=1.0))
    assert np.array_equal(run(base), run(p1))
    assert p1.model.ffn.traffic.totals().dropped == 0


def test_expert_top_p_half_matches_reference_and_never_reads_dropped(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    trace = {}
    want = Reference(str(path)).logits(PROMPT, top_p=0.5, trace=trace)
    s = open_model(
        path, StreamOptions(learn=False, prefetch=False, expert_top_p=0.5, expert_cache_bytes=64 * slot_bytes(path))
    )
    got = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)  # one prefill: no prefetch at all
    assert cosines(got, want).min() >= 0.999
    tot = s.model.ffn.traffic.totals()
    kept = {(layer, e) for layer, routes in trace.items() for sel in routes for e in sel}
    n_kept = sum(len(sel) for routes in trace.values() for sel in routes)
    assert tot.dropped > 0 and tot.routed == n_kept and tot.routed + tot.dropped == len(PROMPT) * 4 * 4
    # exactly the experts the rule keeps were read, each once; the dropped ones never
    assert set(s.model.ffn.source.cache.entries) == kept and tot.miss == len(kept)


def test_budget_too_small_is_one_clear_error(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    with pytest.raises(StreamerError, match=r"too small for this model: it needs at least"):
        open_model(path, StreamOptions(learn=False, ram_budget="64M"))
    with pytest.raises(StreamerError, match="cannot hold one layer's 4 experts"):
        open_model(path, StreamOptions(learn=False, expert_cache_bytes=3 * slot_bytes(path)))


@pytest.mark.parametrize("method,n_tokens", [("_grouped", 5), ("_decode_group", 1)])  # prefill and decode paths
def test_interrupted_forward_leaves_no_expert_referenced(synth_model, monkeypatch, method, n_tokens):
    """Ctrl-C (or an I/O error) mid-layer must release every requested expert, or its slot would be stuck."""
    from streamer.moe_compute import Fused

    path = synth_model("tiny-moe", "Q8_0")
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    s = open_model(path, StreamOptions(learn=False, expert_cache_bytes=8 * slot_bytes(path)))
    real, calls = getattr(Fused, method), []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(Fused, method, flaky)
    with pytest.raises(KeyboardInterrupt):
        s.model.forward(PROMPT[:n_tokens], s.model.new_state())
    cache = s.model.ffn.source.cache
    for entry in cache.entries.values():
        entry.future.result()  # let in-flight reads land
    assert all(e.refs == 0 for e in cache.entries.values())
    monkeypatch.undo()
    assert np.array_equal(run(s), resident)  # and the 8-slot cache still works


def test_prefetches_never_starve_demand_reads(synth_model, monkeypatch):
    """Wrong predictions, slow prefetch reads and pinned experts together must not leave a layer's demand
    reads without a slot (the cache keeps n_expert_used slots out of prefetch's reach)."""
    import time

    from streamer.experts.source import StreamingSource
    from streamer.moe import MoEFFN

    path = synth_model("tiny-moe", "Q8_0")
    tokens = PROMPT[:1]
    resident = open_model(path, StreamOptions(stream=False, learn=False))
    want = resident.model.forward(tokens, resident.model.new_state())
    s = open_model(path, StreamOptions(learn=False, prefetch=True, expert_cache_bytes=12 * slot_bytes(path)))
    cache = s.model.ffn.source.cache
    s.model.forward(tokens, s.model.new_state())
    cache.pin_set = {key for key in cache.entries if key[0] == 1}  # layer 1's experts learned hot
    cache.pin_capacity = 4

    def wrong(self, layer, x):  # predict experts that will not be routed and are not cached
        nxt = layer + 1
        if nxt < self.cfg.n_layer:
            self.predicted[nxt] = np.array([e for e in range(16) if (nxt, e) not in cache.entries][:4])

    real = StreamingSource._load

    def slow(self, entry):
        if entry.prefetched:
            time.sleep(0.2)
        return real(self, entry)

    monkeypatch.setattr(MoEFFN, "after_attention", wrong)
    monkeypatch.setattr(StreamingSource, "_load", slow)
    for _ in range(3):
        assert np.array_equal(s.model.forward(tokens, s.model.new_state()), want)
        assert_cache_consistent(cache)


def test_failed_prefetch_reads_give_their_slot_back(synth_model, monkeypatch):
    """A prefetch read that fails frees its slot; a later demand for that expert reads it again."""
    from streamer.experts.source import StreamingSource
    from streamer.experts.store import ExpertReader

    path = synth_model("tiny-moe", "Q8_0")
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    s = open_model(path, StreamOptions(learn=False, prefetch=True, expert_cache_bytes=10 * slot_bytes(path)))
    prefetched, failed = set(), []
    real_prefetch, real_read = StreamingSource.prefetch, ExpertReader.read

    def note_prefetch(self, layer, experts):
        prefetched.update((layer, int(e)) for e in experts if (layer, int(e)) not in self.cache.entries)
        return real_prefetch(self, layer, experts)

    def flaky_read(self, layer, e, buf):
        if (layer, e) in prefetched:
            prefetched.discard((layer, e))
            failed.append((layer, e))
            raise OSError(5, "simulated I/O error")
        return real_read(self, layer, e, buf)

    monkeypatch.setattr(StreamingSource, "prefetch", note_prefetch)
    monkeypatch.setattr(ExpertReader, "read", flaky_read)
    got = run(s)
    assert failed and np.array_equal(got, resident)
    s.model.ffn.source.drain()
    assert_cache_consistent(s.model.ffn.source.cache)
    assert all(e.future.exception() is None for e in s.model.ffn.source.cache.entries.values())


def test_a_prompt_reuses_idle_slots_before_fresh_ones():
    """grow=False (a prompt's calls) evicts the least recently released idle expert rather than take a slot never
    used; with none it still takes a fresh one, and a landed prefetch is not one (its layer is still to come);
    grow=True (decode) takes fresh slots and keeps what it holds."""
    from streamer.experts.cache import ExpertCache

    cache = ExpertCache(n_slots=6, slot_bytes=1, allocate=False)
    a = loaded(cache, (0, 1), grow=False)
    b = loaded(cache, (0, 2), grow=False)  # a is idle: b takes its slot, a is gone
    assert b.slot == a.slot and (0, 1) not in cache.entries and cache.touched_slots == 1
    held, created = cache.acquire((1, 3), grow=False)  # b is idle: evicted; held stays referenced
    assert created and held.slot == a.slot and cache.touched_slots == 1
    c, _ = cache.acquire((1, 4), grow=False)  # nothing idle: a fresh slot
    assert c.slot != a.slot and cache.touched_slots == 2
    d = loaded(cache, (2, 0), grow=True)  # decode grows into fresh slots and evicts nothing
    assert d.slot not in (a.slot, c.slot) and cache.touched_slots == 3 and cache.evictions == 2
    e = loaded(cache, (2, 1), grow=True)
    assert (2, 0) in cache.entries and e.slot != d.slot and cache.touched_slots == 4
    f = loaded(cache, (3, 0), grow=False)  # an idle slot again: (2, 0), the least recently used
    assert f.slot == d.slot and (2, 0) not in cache.entries and (2, 1) in cache.entries

    cache = ExpertCache(n_slots=4, slot_bytes=1, allocate=False)
    p, _ = cache.acquire((0, 5), prefetch=True, grow=False)  # a prefetch lands: idle, but its layer is to come
    p.future = Future()
    p.future.set_result(None)
    cache.loaded(p)
    assert (0, 5) in cache.idle and (0, 5) not in cache.used
    g, _ = cache.acquire((0, 6), grow=False)
    assert g.slot != p.slot and (0, 5) in cache.entries and cache.touched_slots == 2


def test_a_decode_step_grows_only_into_the_slots_it_is_allowed():
    """allow (per class: fresh slots the prefault threads have faulted in) lets a decode acquire take that many
    never-used slots; then it reuses the least recently released idle slot, as a prompt does, and takes a fresh
    one only when there is none; None allows any."""
    from streamer.experts.cache import ExpertCache, SlotClasses

    cache = ExpertCache(n_slots=8, slot_bytes=1, allocate=False)
    a, b = loaded(cache, (0, 1)), loaded(cache, (0, 2))
    cache.allow = [1]
    c = loaded(cache, (0, 3))
    assert c.slot not in (a.slot, b.slot) and cache.touched_slots == 3 and cache.allow == [0]
    d = loaded(cache, (0, 4))  # allowance spent: a's slot
    assert d.slot == a.slot and (0, 1) not in cache.entries and cache.touched_slots == 3
    held = [cache.acquire((1, e))[0] for e in range(4)]  # referenced: b's, c's, d's slots, then nothing idle
    assert [h.slot for h in held[:3]] == [b.slot, c.slot, d.slot] and cache.evictions == 4
    assert held[3].slot not in (a.slot, b.slot, c.slot) and cache.touched_slots == 4
    cache.allow = None
    assert loaded(cache, (2, 0)).slot not in [h.slot for h in held] and cache.touched_slots == 5

    classes = SlotClasses((0, 1), (1, 2), (3, 3))  # layer 0 in class 0, layer 1 in class 1
    cache = ExpertCache(n_slots=6, slot_bytes=2, allocate=False, classes=classes)
    loaded(cache, (0, 0)), loaded(cache, (1, 0))
    cache.allow = [0, 2]
    loaded(cache, (0, 1)), loaded(cache, (1, 1)), loaded(cache, (1, 2))
    assert cache.fresh == [2, 0] and (0, 0) not in cache.entries and (1, 0) in cache.entries


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_a_prompt_faults_in_only_the_slots_it_reads_into(synth_model, monkeypatch):
    """A streamed prompt's reads fault in no more of the arena than its reads in flight need (the kernel's own
    count: the arena mapping's Rss), however large the cache, short of one with a slot for every expert (the
    tiny model has 64; test_streamed_is_bit_identical_to_resident checks that such a cache reads none twice); the
    tokens after it keep their experts and fault in more; the logits equal the resident run's, bit for bit."""
    path = synth_model("tiny-moe", "Q8_0")
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    sb = slot_bytes(path)
    s = open_model(path, StreamOptions(learn=False, prefetch=False, expert_cache_bytes=48 * sb))
    cache, ffn = s.model.ffn.source.cache, s.model.ffn

    def arena_rss() -> int:
        return rss_bytes(cache.arena.ctypes.data)

    rss0 = arena_rss()  # (the mapping may share its VMA with a few pages of others)
    c = s.model.new_state()
    got = [s.model.forward(PROMPT[:N_PREFILL], c, all_logits=True)]
    in_flight = ffn.tuning.group + ffn.tuning.window  # the prefill's reads run this many experts ahead
    read = s.traffic.totals().miss  # a growing cache would have taken a slot for each
    assert cache.touched_slots <= in_flight < read
    assert cache.touched_slots * sb - 8192 <= arena_rss() - rss0 <= cache.touched_slots * sb + 8192
    got += [s.model.forward(PROMPT[i : i + 1], c, all_logits=True) for i in range(N_PREFILL, len(PROMPT))]
    assert cache.touched_slots > in_flight and cache.evictions > 0
    assert np.array_equal(np.concatenate(got), resident)
    assert_cache_consistent(cache)


def test_a_one_token_prompt_is_a_prompt_too(synth_model):
    """The first forward reuses cache slots even when it is one token (its time to first token is a prompt's);
    the one-token forwards after it grow the cache."""
    path = synth_model("tiny-moe", "Q8_0")
    sb = slot_bytes(path)
    s = open_model(path, StreamOptions(learn=False, prefetch=True, expert_cache_bytes=48 * sb))
    cache, k = s.model.ffn.source.cache, s.model.cfg.n_expert_used
    c = s.model.new_state()
    s.model.forward(PROMPT[:1], c)
    t = s.traffic.totals()
    # a layer's experts and the next one's prefetches, plus any mispredicted prefetch (it waits to be used);
    # growing would have taken a slot for every read
    assert cache.touched_slots <= 2 * k + (t.prefetch_issued - t.prefetch_used) < t.miss + t.prefetch_issued
    first = cache.touched_slots
    s.model.forward(PROMPT[1:2], c)
    assert cache.touched_slots > first


@pytest.mark.slow  # 75 s of first compiles on 2 cores (2026-12-05): over the fast tier's budget
@pytest.mark.parametrize("qtype", ["BF16", "F16", "F32"])
def test_float_experts_match_the_reference_streamed_and_resident(synth_model, qtype):
    """Experts in a float format (BF16 uploads are common) take the per-expert path: streamed == resident."""
    path = synth_model("tiny-moe", qtype)
    resident = run(open_model(path, StreamOptions(stream=False, learn=False)))
    streamed = run(open_model(path, StreamOptions(learn=False, expert_cache_bytes=6 * slot_bytes(path))))
    np.testing.assert_array_equal(streamed, resident)
    assert cosines(resident, Reference(str(path)).logits(PROMPT)).min() >= 0.999
