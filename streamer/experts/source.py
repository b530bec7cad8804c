"""Expert sources: where the MoE layer gets an expert's (gate, up, down) matrices.

Both have the same four calls: request (start making an expert available; False if there is no room),
wait (block until it is, return the matrices), release (done computing with it) and prefetch; serve() is the
one loop that drives them for a layer's experts.
- ResidentSource: experts used in place from the mmap (everything fits, or --no-stream).
- StreamingSource: experts read with explicit preads into the budgeted ExpertCache.
"""

from __future__ import annotations

import itertools
import mmap
import time
import weakref
from collections import deque

import numpy as np

from streamer import timing
from streamer.errors import StreamerError
from streamer.experts.cache import ExpertCache
from streamer.experts.store import ExpertLayout, ExpertReader, Part, ReaderPool
from streamer.kernels import QMatrix
from streamer.traffic import ExpertTraffic

DEMAND, PREFETCH = 0, 1


def part_matrix(gf, p: Part, e: int) -> QMatrix:
    """Expert e's gate, up or down in place in the file's mapping (zero-copy)."""
    rows = gf.view(p.name)[e][p.row0 : p.row0 + p.n_rows]
    return QMatrix(rows, p.qtype, p.n_in, f"{p.name}[{e}]")


PINNED, LRU, PREFETCHED, MISS = 0, 1, 2, 3  # how a request was served (the trace's tier codes)


class ResidentSource:
    """Experts used in place from the mapping. Until every expert has been touched once, each expert about
    to be used (routed, or predicted by the router lookahead) gets MADV_WILLNEED on its three byte ranges:
    the kernel reads exactly those in the background, instead of the whole file up front or a fault at a
    time (expert ranges are MADV_RANDOM, so faults do not read neighbouring experts ahead)."""

    streams = False

    def __init__(self, gf, cfg, traffic: ExpertTraffic):
        self.traffic = traffic
        self.gf = gf
        self.layout = ExpertLayout(gf, cfg)
        self._spans = [  # per layer: where expert 0's gate, up, down start, and each part's bytes between experts
            (np.array([[p.offset] for p in ps], np.int64), np.array([[p.stride] for p in ps], np.int64))
            for ps in self.layout.parts
        ]
        self.mats: dict = {}
        self.touched: set = set()
        self.wants_lookahead = True  # until every expert has been touched once

    in_place = True  # every expert is always there: serve() need not request, wait for or release them
    grow = True  # (StreamingSource's; nothing to grow here)

    def resident(self) -> None:
        """Every expert is in RAM now (the caller read the whole file in): no more read-ahead, no lookahead."""
        self.wants_lookahead = False

    def _warm(self, layer: int, experts) -> None:
        if not self.wants_lookahead:
            return
        new = [(layer, int(e)) for e in experts if (layer, int(e)) not in self.touched]
        if new:
            self.gf.advise(
                [(p.offset + e * p.stride, p.nbytes) for _, e in new for p in self.layout.parts[layer]],
                mmap.MADV_WILLNEED,
            )
            self.touched.update(new)
            self.wants_lookahead = len(self.touched) < self.layout.n_layer * self.layout.n_expert

    def request(self, layer: int, e: int) -> bool:
        st = self.traffic.layers[layer]
        st.requests += 1
        st.hit_pinned += 1  # resident: every expert is always there
        if self.traffic.trace is not None:
            self.traffic.trace.request(layer, e, PINNED, 0)
        self._warm(layer, (e,))
        return True

    def present(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Which of ids (any shape) are cached or being read: all of them, always."""
        return np.ones(ids.shape, bool)

    def request_all(self, layer: int, experts) -> None:
        """request() for each of experts, counted at once (they are all in place)."""
        st = self.traffic.layers[layer]
        st.requests += len(experts)
        st.hit_pinned += len(experts)
        if self.traffic.trace is not None:
            for e in experts:
                self.traffic.trace.request(layer, int(e), PINNED, 0)
        self._warm(layer, experts)

    def prefetch(self, layer: int, experts) -> None:
        self._warm(layer, experts)

    def announce(self, layer: int, experts) -> None:
        """All experts this layer call will request (a prefill needs many: read them ahead together)."""
        self._warm(layer, experts)

    def drain(self) -> None:
        pass

    def offsets(self, layer: int, group):
        """(base array, byte offsets in it of the group's gates, then ups, then downs, int64): experts in place
        in the file's mapping."""
        start, size = self._spans[layer]
        return self.gf.mm, (start + size * np.asarray(group, np.int64)).reshape(-1)

    def spans(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets in the mapping of expert 0's gate, up and down, and each part's bytes between experts."""
        start, size = self._spans[layer]
        return start.reshape(-1), size.reshape(-1)

    def wait(self, layer: int, e: int):
        m = self.mats.get((layer, e))
        if m is None:
            m = self.mats[(layer, e)] = tuple(part_matrix(self.gf, p, e) for p in self.layout.parts[layer])
        return m

    def release(self, layer: int, e: int) -> None:
        pass

    def limit_growth(self) -> None:
        pass

    def close(self) -> None:
        pass


class StreamingSource:
    wants_lookahead = True
    streams = True
    in_place = False
    grow = True  # False (the MoE layer's prompt calls): reuse idle slots before fresh ones (ExpertCache.acquire)

    def __init__(
        self,
        files: list[tuple[str, int]],
        layout: ExpertLayout,
        cache: ExpertCache,
        traffic: ExpertTraffic,
        n_readers: int = 4,
        direct: bool | None = None,
    ):
        """files: (path, base in the mapping) of each file of the model (GGUFFile.files)."""
        self.layout, self.cache, self.traffic = layout, cache, traffic
        self.reader = ExpertReader(files, layout, direct)
        self.pool = ReaderPool(n_readers)
        self._close = weakref.finalize(self, _shutdown, self.pool, self.reader, cache.prefaulter)  # close, GC, exit

    def _load(self, entry) -> tuple:
        layer, e = entry.key
        buf = self.cache.slot_buffer(entry.slot, layer)
        try:
            offs = self.reader.read(layer, e, buf)
        except BaseException:
            self.cache.discard(entry, unless_referenced=True)  # a prefetch nobody waits for: free its slot
            raise
        mats = tuple(
            QMatrix(buf[o : o + p.nbytes].reshape(p.n_rows, -1), p.qtype, p.n_in, f"{p.name}[{e}]")
            for o, p in zip(offs, self.layout.parts[layer])
        )
        start = self.cache.slot_offset(entry.slot, layer)
        entry.offsets = tuple(start + o for o in offs)
        clock = self.cache.loaded(entry)
        if self.traffic.trace is not None:
            self.traffic.trace.landed(layer, e, clock)
        return mats

    def _start(self, entry, priority: int) -> None:
        timing.mark("experts_first_read")
        entry.future = self.pool.submit(priority, self._load, entry)

    def limit_growth(self) -> None:
        """At each layer call, once routed: a decode step's call grows the cache only into the slots the
        prefault threads have faulted in (ExpertCache.allow); the trace records that, for the replay."""
        allow = self.cache.allow = self.cache.ready() if self.grow else None
        if allow is not None and self.traffic.trace is not None:
            self.traffic.trace.allowed(allow)

    def request(self, layer: int, e: int) -> bool:
        old = self.cache.entries.get((layer, e))
        if old is not None and old.future is not None and old.future.done() and old.future.exception():
            self.cache.discard(old)  # a failed prefetch: read it again on demand
        entry, created = self.cache.acquire((layer, e), grow=self.grow)
        if entry is None:
            return False
        st, nbytes = self.traffic.layers[layer], 0
        st.requests += 1
        if created:
            st.miss += 1
            nbytes = self.layout.expert_bytes(layer)
            st.read_bytes += nbytes
            tier = MISS
            self._start(entry, DEMAND)
        elif entry.prefetched:
            entry.prefetched = False
            st.hit_prefetched += 1
            st.prefetch_used += 1
            tier = PREFETCHED
        elif entry.pinned:
            st.hit_pinned += 1
            tier = PINNED
        else:
            st.hit_lru += 1
            tier = LRU
        if self.traffic.trace is not None:
            self.traffic.trace.request(layer, e, tier, nbytes)
        return True

    def present(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Which of ids (any shape; -1 for none) have a cache entry now: read, or a read in flight."""
        u, inv = np.unique(ids, return_inverse=True)
        entries = self.cache.entries
        return np.array([(layer, e) in entries for e in u.tolist()], bool)[inv].reshape(ids.shape)

    def prefetch(self, layer: int, experts) -> None:
        st = self.traffic.layers[layer]
        for e in experts:
            if (layer, e) in self.cache.entries:
                continue
            entry, created = self.cache.acquire((layer, e), prefetch=True, grow=self.grow)
            if entry is None:
                return  # no idle slot to reuse: prefetching would evict what is in use
            if created:
                st.prefetch_issued += 1
                st.prefetch_bytes += self.layout.expert_bytes(layer)
                if self.traffic.trace is not None:  # before the read starts: its landing is recorded against it
                    self.traffic.trace.prefetched(layer, e, self.layout.expert_bytes(layer), self.cache.ops)
                self._start(entry, PREFETCH)

    def wait(self, layer: int, e: int):
        """Block until expert (layer, e), requested before, is in the cache; its (gate, up, down) QMatrix.
        A failed read (say, of a prefetch this demand caught in flight) is retried once before giving up."""
        entry = self.cache.entries[(layer, e)]
        for attempt in (0, 1):
            fut = entry.future
            if not fut.done():
                t0 = time.perf_counter()
                try:
                    fut.exception()
                finally:
                    dt = time.perf_counter() - t0
                    self.traffic.layers[layer].stall_s += dt
                    if self.traffic.trace is not None:
                        self.traffic.trace.stall(layer, e, dt)
            err = fut.exception()
            if err is None:
                return fut.result()
            if attempt == 0:
                self._start(entry, DEMAND)
        self.cache.discard(entry)
        if isinstance(err, StreamerError):
            raise err
        raise StreamerError(f"I/O error reading expert {e} of layer {layer}: {err}") from None

    def announce(self, layer: int, experts) -> None:
        pass  # reads start on request, as many as the window and the cache allow

    def drain(self) -> None:
        """Wait for every read in flight (prefetches): their slots become evictable."""
        for entry in list(self.cache.entries.values()):
            if entry.future is not None:
                try:
                    entry.future.result()
                except BaseException:  # a failed prefetch has already given its slot back
                    pass

    def offsets(self, layer: int, group):
        """(base array, byte offsets in it of the group's gates, then ups, then downs, int64), for experts
        that wait() returned."""
        offs = [self.cache.entries[(layer, int(e))].offsets for e in group]
        return self.cache.flat, np.array([o[j] for j in range(3) for o in offs], np.int64)

    def release(self, layer: int, e: int) -> None:
        entry = self.cache.entries.get((layer, e))
        if entry is not None and entry.refs > 0:  # a failed read already discarded its entry
            self.cache.release(entry)

    def close(self) -> None:
        self._close()


def _shutdown(pool: ReaderPool, reader: ExpertReader, prefaulter) -> None:
    if prefaulter is not None:
        prefaulter.stop()
    pool.close()
    reader.close()


def serve(source, layer: int, experts, compute, window: int | None = None, prefetch_next=None, group: int = 1) -> None:
    """The one request/prefetch/release loop over a layer's experts (ascending ids), for both ways of computing
    them. window None: request all of them (as many as the cache gives at once), then call compute on the
    whole group. window N: request up to N ahead, and call compute on the first `group` of them (fewer if
    fewer are requested) as they are ready, while the reads of the others go on. Either
    way compute(start, group, mats) gets the experts' index in `experts`, their ids and (gate, up, down); the
    next layer's predicted experts are prefetched once this layer's own misses are queued; and every request
    is released, even on Ctrl-C or an I/O error, so no slot stays referenced forever. A source whose experts
    are all in place (ResidentSource) is asked for them at once in together mode, and compute gets None for
    the matrices (it finds the experts with source.offsets)."""
    together = window is None
    if source.in_place and (together or group >= len(experts)):
        source.request_all(layer, experts)
        if prefetch_next is not None:
            source.prefetch(layer + 1, prefetch_next)
        compute(0, experts, None if together else [source.wait(layer, int(e)) for e in experts])
        return
    window = len(experts) if together else window
    pending, i, stuck = deque(), 0, False
    try:
        while i < len(experts) or pending:
            while i < len(experts) and len(pending) < window and source.request(layer, int(experts[i])):
                pending.append(int(experts[i]))
                i += 1
            if prefetch_next is not None and (together or i == len(experts)):
                source.prefetch(layer + 1, prefetch_next)
                prefetch_next = None
            if not pending:
                stuck = _no_room(source, layer, stuck)
                continue
            stuck = False
            batch = list(pending) if together else list(itertools.islice(pending, group))
            compute(i - len(pending), batch, [source.wait(layer, e) for e in batch])
            for e in batch:
                pending.popleft()
                source.release(layer, e)
    finally:
        for e in pending:
            source.release(layer, e)


def _no_room(source, layer: int, stuck: bool) -> bool:
    """Nothing could be requested. First time: wait for in-flight prefetches to land (their slots become
    evictable) and let the caller retry. The cache reserves room for a layer's demand reads, so a second
    time means the cache really is full of pinned and in-use experts."""
    if stuck:
        raise StreamerError(
            f"the expert cache has no room for layer {layer}'s experts: every slot is pinned "
            f"or in use (raise --ram-budget)"
        )
    source.drain()
    return True
