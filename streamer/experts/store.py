"""Where each expert's bytes are in the file, and reading them with explicit preads that bypass the page cache.

Expert e of `blk.L.ffn_{gate,up,down}_exps.weight` is one contiguous slab of each tensor, so an expert is
three reads. With O_DIRECT the reads are widened to 4 KiB boundaries into 4 KiB-aligned buffers (< 1%
extra bytes for real expert sizes) and nothing lands in the OS page cache. Where O_DIRECT is refused
(tmpfs, some network filesystems) reads are buffered: POSIX_FADV_RANDOM on the descriptor stops the
kernel reading neighbouring experts ahead, and POSIX_FADV_DONTNEED after each read drops the pages read,
so the page cache does not keep a second copy of what our cache holds.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from streamer.errors import StreamerError

ALIGN = 4096
PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class Part:
    """One of gate/up/down of every expert of a layer: expert e starts at offset + e * nbytes."""
    name: str
    offset: int
    nbytes: int
    qtype: object
    n_rows: int
    n_in: int


def aligned_span(start: int, nbytes: int) -> tuple[int, int, int]:
    """(aligned file offset, aligned length, offset of the data inside the span)."""
    a0 = start // ALIGN * ALIGN
    a1 = -(-(start + nbytes) // ALIGN) * ALIGN
    return a0, a1 - a0, start - a0


class ExpertLayout:
    def __init__(self, gf, cfg):
        self.n_layer, self.n_expert = cfg.n_layer, cfg.n_expert
        self.parts: list[tuple[Part, ...]] = []
        for i in range(cfg.n_layer):
            ps = []
            for p in PARTS:
                t = gf.tensors[f"blk.{i}.ffn_{p}_exps.weight"]
                ps.append(Part(t.name, t.offset, t.nbytes // cfg.n_expert, t.qtype, t.shape[1], t.shape[2]))
            self.parts.append(tuple(ps))
        # one slot holds any expert: a part of n bytes spans at most ceil((n + 4095) / 4096) pages
        self.slot_bytes = max(sum(-(-(p.nbytes + ALIGN - 1) // ALIGN) * ALIGN for p in ps) for ps in self.parts)

    def expert_bytes(self, layer: int) -> int:
        return sum(p.nbytes for p in self.parts[layer])

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(i) for i in range(self.n_layer)) * self.n_expert


class ExpertReader:
    """Reads one expert's three parts into a caller-owned buffer; returns each part's offset in it."""

    def __init__(self, path: str, layout: ExpertLayout, direct: bool | None = None):
        self.layout = layout
        self.path = path
        self.direct = False
        if direct is not False and hasattr(os, "O_DIRECT"):
            self.direct = self._try_direct()
        if direct is True and not self.direct:
            raise StreamerError(f"{path}: the filesystem refuses O_DIRECT reads (try --io buffered)")
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into neighbouring experts

    def _try_direct(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        buf = aligned_empty(ALIGN)
        try:
            os.preadv(fd, [memoryview(buf)], 0)
        except OSError:
            os.close(fd)
            return False
        self.dfd = fd
        return True

    def read(self, layer: int, e: int, buf: np.ndarray) -> tuple[int, int, int]:
        """Fill buf (aligned, >= slot_bytes) with expert (layer, e); offsets of gate, up, down inside buf."""
        mv = memoryview(buf)
        pos, offs = 0, []
        for p in self.layout.parts[layer]:
            start = p.offset + e * p.nbytes
            try:
                if self.direct:
                    a0, alen, inner = aligned_span(start, p.nbytes)
                    got = os.preadv(self.dfd, [mv[pos:pos + alen]], a0)
                    offs.append(pos + inner)
                    pos += alen
                    need = inner + p.nbytes
                else:
                    got = os.preadv(self.fd, [mv[pos:pos + p.nbytes]], start)
                    a0, alen, _ = aligned_span(start, p.nbytes)  # whole pages, edges included
                    os.posix_fadvise(self.fd, a0, alen, os.POSIX_FADV_DONTNEED)
                    offs.append(pos)
                    pos += -(-p.nbytes // ALIGN) * ALIGN
                    need = p.nbytes
            except OSError as err:
                raise StreamerError(f"I/O error reading expert {e} of {p.name}: {err.strerror or err}") from None
            if got < need:
                raise StreamerError(f"{self.path}: short read of expert {e} of {p.name} (file truncated?)")
        return offs[0], offs[1], offs[2]

    def close(self) -> None:
        os.close(self.fd)
        if self.direct:
            os.close(self.dfd)


def aligned_empty(nbytes: int) -> np.ndarray:
    """Uninitialised uint8 buffer whose data pointer is 4 KiB aligned (O_DIRECT needs it)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + nbytes]


class ReaderPool:
    """A few threads running read jobs; demand reads (priority 0) go before prefetches (priority 1),
    first come first served within a priority. pread releases the GIL, so reads overlap compute."""

    def __init__(self, n_threads: int = 4):
        self.q: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"expert-reader-{i}")
                        for i in range(n_threads)]
        for t in self.threads:
            t.start()

    def submit(self, priority: int, fn, *args) -> Future:
        fut: Future = Future()
        self.q.put((priority, next(self.seq), fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fn, args, fut = self.q.get()
            if fn is None:
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to whoever waits on the future
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self.threads:
            self.q.put((2, next(self.seq), None, (), None))
        for t in self.threads:
            t.join()
