"""The expert cache: a fixed arena of slots (allocated once, so its size is the budget we were given; one slot size per
kind of layer, SlotClasses), split into a pinned tier (experts learned to be hot; never evicted) and an LRU tier
(cachetools) of idle experts, each per slot size. Experts in use by the current layer, or still being read, sit in
neither tier and cannot be evicted. Thread-safe: reader threads complete entries while the compute thread acquires and
releases.

A slot never used yet is memory the process has not touched: its first read also faults in and zeroes it, which on a
VM whose host took back free memory is slower than the disk. So acquire(grow=False) reuses the slot of an idle expert
that was used before taking a fresh one, and a decode step grows into fresh slots only as far as
experts/prefault.py's threads have faulted them in on idle CPU (`allow`, set per layer call from ready()). Which
experts were used is decided by the compute thread's own calls and `allow` is recorded in the trace, so the replay
makes the same choices (2026-12-06: 1.20 against 0.90 tok/s growing freely, on lazily backed memory)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import NamedTuple

from cachetools import LRUCache

from streamer.buffers import arena_empty
from streamer.experts.prefault import Prefaulter

PREFAULT = True  # fault in never-used slots ahead of need, on idle CPU (experts/prefault.py); tests turn it off


def grows(roomy: bool, m: int, step: int) -> bool:
    """acquire's grow for a layer call of m tokens in forward `step` (0: the session's first): False for a prompt
    (several tokens, or the first forward), unless the cache is roomy (a slot for every expert: it never evicts).
    The MoE layer and the trace replay both decide by this."""
    return roomy or (m == 1 and step > 0)


class SlotClasses(NamedTuple):
    """Slots of several sizes, one size per class: a layer's experts take slots of its layer's class only.
    Quantization recipes give some layers larger experts (Q4_K_M's Q6_K ffn_down in about half the layers): with one
    slot size, the other layers' slots would carry the difference unused."""

    of_layer: tuple[int, ...]  # each layer's class
    slot_bytes: tuple[int, ...]  # per class
    n_slots: tuple[int, ...]  # per class


class _PerClass:
    """One mapping per slot class, seen as one: key (layer, e) lives in its layer's class's part."""

    def __init__(self, parts: list, of_layer):
        self.parts, self.of_layer = parts, of_layer

    def part(self, key):
        return self.parts[self.of_layer[key[0]] if self.of_layer else 0]

    def __contains__(self, key) -> bool:
        return key in self.part(key)

    def __getitem__(self, key):
        return self.part(key)[key]

    def __setitem__(self, key, entry) -> None:
        self.part(key)[key] = entry

    def pop(self, key, default=None):
        return self.part(key).pop(key, default)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __iter__(self):
        return (key for p in self.parts for key in list(p))


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
        classes: SlotClasses | None = None,
    ):
        """reserve: slots prefetches must leave free or idle (in each class), so a layer's demand reads always
        find room. allocate=False: the bookkeeping without the arena (the trace replay simulates the cache with
        it). quotas: slots per layer (see _LayerIdle) instead of one LRU over all layers. classes: slots of
        several sizes (n_slots and slot_bytes are then their total and the largest)."""
        if classes is None:
            classes = SlotClasses((), (slot_bytes,), (n_slots,))
        assert min(classes.n_slots) >= 1 and sum(classes.n_slots) == n_slots
        self.n_slots, self.slot_bytes, self.classes = n_slots, max(classes.slot_bytes), classes
        self.of_layer = classes.of_layer or None
        self.firsts, self.bases = [], []  # per class: its first slot's number, its first byte in the arena
        slot = base = 0
        for n, size in zip(classes.n_slots, classes.slot_bytes):
            self.firsts.append(slot)
            self.bases.append(base)
            slot, base = slot + n, base + n * size
        self.capacity_bytes = base
        if allocate:
            self.arena = arena_empty(base)  # writable: reads land here
            self.flat = self.arena[:]  # the same bytes, read-only, for the multi-expert kernels
            self.flat.flags.writeable = False
        self.prefaulter = None
        # per class a stack of free slots: slots given back are taken again first; the bottom `fresh` of each
        # were never used
        self.frees = [list(range(f + n - 1, f - 1, -1)) for f, n in zip(self.firsts, classes.n_slots)]
        self.fresh = list(classes.n_slots)
        n_cls = len(classes.n_slots)
        # idle entries released since their read, least recent first
        self.used = self.per_class(lambda c: OrderedDict())
        self.entries: dict = {}
        self.held = [0] * (len(quotas) if quotas is not None else 0)  # entries per layer (with quotas)
        self.idle = self.per_class(
            lambda c: (
                _Idle(classes.n_slots[c], self._evicted)
                if quotas is None
                else _LayerIdle(quotas, self.held, self._evicted)
            )
        )
        self.lock = threading.Lock()
        self.pin_set = set(pins)
        self.pin_capacity = min(pin_capacity, n_slots)
        self.n_pinned = 0
        self.class_pinned = [0] * n_cls
        self.reserve = reserve
        self.allow: list[int] | None = None  # per class, the fresh slots acquire may still take (None: any)
        self.evictions = 0
        self.ops = 0  # acquire + release calls so far: the clock a trace times prefetch landings by
        if allocate and PREFAULT:
            me = weakref.ref(self)  # the thread must not keep the cache (and its arena) alive
            self.prefaulter = Prefaulter(self.flat, lambda: None if (c := me()) is None else c.untouched())

    def per_class(self, make) -> _PerClass:
        """A mapping made of make(c) for each class c: the idle tier, the reuse order (the trace replay sets its
        policies' idle tiers this way)."""
        return _PerClass([make(c) for c in range(len(self.frees))], self.of_layer)

    def cls(self, layer: int) -> int:
        return self.of_layer[layer] if self.of_layer else 0

    def slot_offset(self, slot: int, layer: int) -> int:
        """Where slot (of layer's class) starts in the arena."""
        c = self.cls(layer)
        return self.bases[c] + (slot - self.firsts[c]) * self.classes.slot_bytes[c]

    def slot_buffer(self, slot: int, layer: int):
        """The writable bytes of slot (of layer's class)."""
        start = self.slot_offset(slot, layer)
        return self.arena[start : start + self.classes.slot_bytes[self.cls(layer)]]

    @property
    def free(self) -> list[int]:
        return [s for f in self.frees for s in f]

    @property
    def held_bytes(self) -> int:
        return sum((n - len(f)) * b for n, f, b in zip(self.classes.n_slots, self.frees, self.classes.slot_bytes))

    def census(self) -> dict:
        """Slots by state: in_use (referenced by a layer call), reading (a read in flight), pinned, idle (LRU,
        evictable), free. Between generations in_use and reading must be 0."""
        with self.lock:
            es = list(self.entries.values())
            n_free = sum(len(f) for f in self.frees)
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
        self.frees[self.cls(entry.key[0])].append(entry.slot)
        self.evictions += 1

    @property
    def touched_slots(self) -> int:
        """Slots used at least once (their pages are faulted in)."""
        return self.n_slots - sum(self.fresh)

    def untouched(self) -> list[tuple[int, int]]:
        """Per class, the arena's byte range of its never-used slots (the prefault threads' work)."""
        return [
            (b + (n - f) * size, b + n * size)
            for b, n, f, size in zip(self.bases, self.classes.n_slots, self.fresh, self.classes.slot_bytes)
        ]

    def ready(self) -> list[int] | None:
        """Per class, how many never-used slots the prefault threads have faulted in (the next ones acquire
        takes); None when nothing limits growth (no prefault threads, or they stopped on an error)."""
        p = self.prefaulter
        if p is None:
            return None
        out = []
        for (start, end), size in zip(self.untouched(), self.classes.slot_bytes):
            reached = p.faulted(end)
            if reached is None:
                return None
            out.append(max(0, (reached - start) // size))
        return out

    def acquire(self, key, prefetch: bool = False, grow: bool = True) -> tuple[Entry | None, bool]:
        """(entry, created). A demand acquire takes a reference (release() gives it back); a prefetch does
        not. A new entry has a slot but no data: the caller must start its read and set entry.future.
        (None, False) when every slot of its class is pinned, in use or being read, or (prefetch) when taking
        one would leave fewer than `reserve` free or idle slots of the class for demand reads. grow=False: a new
        entry takes the slot of the least recently released idle entry of its class (self.used) rather than
        one never used before; so does grow=True once the class's `allow` is spent."""
        with self.lock:
            self.ops += 1
            e = self.entries.get(key)
            c = self.cls(key[0])
            free, idle = self.frees[c], self.idle.parts[c]
            if prefetch and e is None and len(free) + len(idle) <= self.reserve:
                return None, False
            if e is not None:
                if not prefetch:
                    e.refs += 1
                    self.idle.pop(key, None)
                    self.used.pop(key, None)
                return e, False
            used = self.used.parts[c]
            if self.allow is not None and self.allow[c] <= 0:
                grow = False
            if free and not grow and len(free) <= self.fresh[c] and used:
                old, victim = used.popitem(last=False)
                idle.pop(old)
                self._evicted(victim)
            elif not free:
                if not idle:
                    return None, False
                if self.held:
                    idle.popitem(key[0])
                else:
                    idle.popitem()
            if self.held:
                self.held[key[0]] += 1
            # pins never take a class's last two layers' worth of slots (the reserve's, twice)
            pinned = (
                key in self.pin_set
                and self.n_pinned < self.pin_capacity
                and self.class_pinned[c] < self.classes.n_slots[c] - 2 * self.reserve
            )
            self.n_pinned += pinned
            self.class_pinned[c] += pinned
            if len(free) <= self.fresh[c]:  # a never-used slot
                self.fresh[c] -= 1
                if self.allow is not None:
                    self.allow[c] -= 1
            e = self.entries[key] = Entry(key, free.pop(), pinned, prefetch)
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
                self.frees[self.cls(e.key[0])].append(e.slot)
                self.n_pinned -= e.pinned
                self.class_pinned[self.cls(e.key[0])] -= e.pinned


def cache_slots(
    expert_cache_bytes: int, layer_slot_bytes, n_expert: int, n_used: int, pin_share: float
) -> tuple[int, int, SlotClasses | None]:
    """(slots, pin capacity, slot classes) of an expert cache of this many bytes, for layers whose experts
    need slots of layer_slot_bytes[i]: one class per slot size, each holding the same share of its layers'
    experts (routing spreads a token's reads over every layer alike), or one class of the largest size
    (classes None) where the sizes are all equal or some class would get fewer than two layers' worth of
    slots. Pins never take the last two layers' worth of slots. The trace replay sizes its caches with this."""
    n_layer, big = len(layer_slot_bytes), max(layer_slot_bytes)
    sizes = sorted(set(layer_slot_bytes))
    classes = None
    if len(sizes) > 1:
        layers = [sum(1 for b in layer_slot_bytes if b == size) for size in sizes]
        share = expert_cache_bytes / sum(n * n_expert * size for n, size in zip(layers, sizes))
        per = tuple(min(int(share * n * n_expert), n * n_expert) for n in layers)
        if min(per) >= 2 * n_used:
            classes = SlotClasses(tuple(sizes.index(b) for b in layer_slot_bytes), tuple(sizes), per)
    n_slots = sum(classes.n_slots) if classes else min(expert_cache_bytes // big, n_layer * n_expert)
    return n_slots, max(min(int(pin_share * n_slots), n_slots - 2 * n_used), 0), classes
