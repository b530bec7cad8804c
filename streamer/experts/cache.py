"""The expert cache: a fixed arena of equal slots (allocated once, so its size is the budget we were given),
split into a pinned tier (experts learned to be hot; never evicted) and an LRU tier (cachetools) of idle
experts. Experts in use by the current layer, or still being read, sit in neither tier and cannot be
evicted. Thread-safe: reader threads complete entries while the compute thread acquires and releases.

A slot never used yet is memory the process has not touched: its first read faults in and zeroes every page of
it (the kernel's first touch, which on a VM whose host took back free memory ran at 0.6 GB/s of CPU time inside
the O_DIRECT reads, slower than the disk). acquire(grow=False) reuses the slot of an idle expert that was used (released, not a
prefetch still waiting for its layer) before such a fresh one: a prompt, which reads each layer's experts once,
then touches only the slots its reads in flight need, not the whole arena. Which experts were used is decided
by the compute thread's own calls, never by when a read lands, so the trace replay makes the same choices. The
fresh slots, which the tokens after a prompt grow into, are faulted in meanwhile on idle CPU (experts/prefault.py)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future

from cachetools import LRUCache

from streamer.buffers import arena_empty
from streamer.experts.prefault import Prefaulter

PREFAULT = True  # fault in never-used slots ahead of need, on idle CPU (experts/prefault.py); tests turn it off


def grows(roomy: bool, m: int, step: int) -> bool:
    """acquire's grow for a layer call of m tokens in forward `step` (0: the session's first): False for a prompt
    (several tokens, or the first forward), unless the cache is roomy (a slot for every expert: it never evicts).
    The MoE layer and the trace replay both decide by this."""
    return roomy or (m == 1 and step > 0)


class Entry:
    __slots__ = ("key", "slot", "future", "refs", "pinned", "prefetched", "offsets")

    def __init__(self, key, slot: int, pinned: bool, prefetched: bool):
        self.key, self.slot, self.pinned, self.prefetched = key, slot, pinned, prefetched
        self.refs = 0
        self.future: Future | None = None  # result: (gate, up, down) QMatrix over this slot
        self.offsets: tuple = ()  # byte offsets of gate, up, down in the flat arena, once read


class _Idle(LRUCache):
    """Idle unpinned experts in LRU order; evicting one hands its slot back."""

    def __init__(self, maxsize, on_evict):
        super().__init__(maxsize)
        self.on_evict = on_evict

    def popitem(self):
        key, entry = super().popitem()
        self.on_evict(entry)
        return key, entry


class _LayerIdle:
    """Idle unpinned experts per layer, each in LRU order, for a cache with per-layer slot quotas: a new
    expert takes the least recently used idle slot of the layer furthest above its quota (its own layer on
    a tie), so a layer below its quota keeps its experts while others are over theirs."""

    def __init__(self, quotas, held, on_evict):
        self.quotas, self.held, self.on_evict = list(quotas), held, on_evict
        self.by = [OrderedDict() for _ in self.quotas]
        self.n = 0

    def __setitem__(self, key, entry) -> None:
        d = self.by[key[0]]
        self.n += key not in d
        d[key] = entry
        d.move_to_end(key)

    def pop(self, key, default=None):
        e = self.by[key[0]].pop(key, None)
        if e is None:
            return default
        self.n -= 1
        return e

    def popitem(self, layer: int = 0):
        over = [(self.held[i] - self.quotas[i], i == layer, -i) for i in range(len(self.by)) if self.by[i]]
        victim = -max(over)[2]
        key, entry = self.by[victim].popitem(last=False)
        self.n -= 1
        self.on_evict(entry)
        return key, entry

    def __len__(self) -> int:
        return self.n

    def __contains__(self, key) -> bool:
        return key in self.by[key[0]]

    def __iter__(self):
        return (key for d in self.by for key in list(d))


class ExpertCache:
    def __init__(
        self,
        n_slots: int,
        slot_bytes: int,
        pins=(),
        pin_capacity: int = 0,
        reserve: int = 0,
        allocate: bool = True,
        quotas=None,
    ):
        """reserve: slots prefetches must leave free or idle, so a layer's demand reads always find room.
        allocate=False: the bookkeeping without the arena (the trace replay simulates the cache with it).
        quotas: slots per layer (see _LayerIdle) instead of one LRU over all layers."""
        assert n_slots >= 1
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        if allocate:
            self.arena = arena_empty(n_slots * slot_bytes).reshape(n_slots, slot_bytes)
            self.flat = self.arena.reshape(-1)[:]  # the same bytes, read-only, for the multi-expert kernels
            self.flat.flags.writeable = False
        self.prefaulter = None
        self.free = list(range(n_slots - 1, -1, -1))  # a stack: slots given back are taken again first
        self.fresh = n_slots  # the bottom `fresh` slots of the free stack were never used
        self.used: OrderedDict = OrderedDict()  # idle entries released since their read, least recent first
        self.entries: dict = {}
        self.held = [0] * (len(quotas) if quotas is not None else 0)  # entries per layer (with quotas)
        self.idle = _Idle(n_slots, self._evicted) if quotas is None else _LayerIdle(quotas, self.held, self._evicted)
        self.lock = threading.Lock()
        self.pin_set = set(pins)
        self.pin_capacity = min(pin_capacity, n_slots)
        self.n_pinned = 0
        self.reserve = reserve
        self.evictions = 0
        self.ops = 0  # acquire + release calls so far: the clock a trace times prefetch landings by
        if allocate and PREFAULT:
            me = weakref.ref(self)  # the thread must not keep the cache (and its arena) alive
            self.prefaulter = Prefaulter(
                self.flat, lambda: None if (c := me()) is None else c.touched_slots * slot_bytes
            )

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def held_bytes(self) -> int:
        return (self.n_slots - len(self.free)) * self.slot_bytes

    def census(self) -> dict:
        """Slots by state: in_use (referenced by a layer call), reading (a read in flight), pinned, idle (LRU,
        evictable), free. Between generations in_use and reading must be 0."""
        with self.lock:
            es = list(self.entries.values())
            n_free = len(self.free)
        reading = sum(1 for e in es if e.refs == 0 and (e.future is None or not e.future.done()))
        in_use = sum(1 for e in es if e.refs > 0)
        pinned = sum(1 for e in es if e.refs == 0 and e.pinned and e.future is not None and e.future.done())
        return dict(
            in_use=in_use, reading=reading, pinned=pinned, idle=len(es) - in_use - reading - pinned, free=n_free
        )

    def _evicted(self, entry: Entry) -> None:
        self.used.pop(entry.key, None)
        if self.held:
            self.held[entry.key[0]] -= 1
        del self.entries[entry.key]
        self.free.append(entry.slot)
        self.evictions += 1

    @property
    def touched_slots(self) -> int:
        """Slots used at least once (their pages are faulted in)."""
        return self.n_slots - self.fresh

    def acquire(self, key, prefetch: bool = False, grow: bool = True) -> tuple[Entry | None, bool]:
        """(entry, created). A demand acquire takes a reference (release() gives it back); a prefetch does
        not. A new entry has a slot but no data: the caller must start its read and set entry.future.
        (None, False) when every slot is pinned, in use or being read, or (prefetch) when taking one would
        leave fewer than `reserve` free or idle slots for demand reads. grow=False: a new entry takes the slot
        of the least recently released idle entry (self.used) rather than one never used before."""
        with self.lock:
            self.ops += 1
            e = self.entries.get(key)
            if prefetch and e is None and len(self.free) + len(self.idle) <= self.reserve:
                return None, False
            if e is not None:
                if not prefetch:
                    e.refs += 1
                    self.idle.pop(key, None)
                    self.used.pop(key, None)
                return e, False
            if self.free and not grow and len(self.free) <= self.fresh and self.used:
                old, victim = self.used.popitem(last=False)
                self.idle.pop(old)
                self._evicted(victim)
            elif not self.free:
                if not self.idle:
                    return None, False
                if self.held:
                    self.idle.popitem(key[0])
                else:
                    self.idle.popitem()
            if self.held:
                self.held[key[0]] += 1
            pinned = key in self.pin_set and self.n_pinned < self.pin_capacity
            self.n_pinned += pinned
            self.fresh -= len(self.free) <= self.fresh
            e = self.entries[key] = Entry(key, self.free.pop(), pinned, prefetch)
            e.refs = 0 if prefetch else 1
            return e, True

    def loaded(self, e: Entry) -> int:
        """A read finished: an unreferenced, unpinned entry becomes idle (evictable). Returns the op clock."""
        with self.lock:
            if e.refs == 0 and not e.pinned and self.entries.get(e.key) is e:
                self.idle[e.key] = e
            return self.ops

    def release(self, e: Entry) -> None:
        with self.lock:
            self.ops += 1
            e.refs -= 1
            assert e.refs >= 0, e.key
            if e.refs == 0 and not e.pinned and e.future is not None and e.future.done():
                self.idle[e.key] = e
                self.used[e.key] = e

    def discard(self, e: Entry, unless_referenced: bool = False) -> None:
        """Forget an entry whose read failed (if unless_referenced, only when nobody holds it)."""
        with self.lock:
            if self.entries.get(e.key) is e and not (unless_referenced and e.refs):
                del self.entries[e.key]
                if self.held:
                    self.held[e.key[0]] -= 1
                self.idle.pop(e.key, None)
                self.used.pop(e.key, None)
                self.free.append(e.slot)
                self.n_pinned -= e.pinned


def cache_slots(
    expert_cache_bytes: int, slot_bytes: int, n_layer: int, n_expert: int, n_used: int, pin_share: float
) -> tuple[int, int]:
    """(slots, pin capacity) of an expert cache of this many bytes: pins never take the last two layers' worth
    of slots. The trace replay sizes its simulated caches with this too."""
    n_slots = min(expert_cache_bytes // slot_bytes, n_layer * n_expert)
    return n_slots, max(min(int(pin_share * n_slots), n_slots - 2 * n_used), 0)
