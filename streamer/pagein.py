"""Page-in: bring byte ranges of the model's mapping into RAM at the disk's sequential speed.

The ranges are read in the order given (the order the forward pass needs them), in pieces of at most `chunk` bytes.
MADV_WILLNEED queues the kernel's reads up to `ahead` bytes past the piece being waited for: large asynchronous requests
covering exactly those pages, several in flight, so the device streams. Each WILLNEED is issued in steps of the
readahead limit (readahead_bytes), since the kernel truncates longer ones and a page left out would later be faulted in
with read_ahead_kb around it, past the range. MADV_POPULATE_READ on the current piece then waits for its pages and maps
them, so the kernels take no page faults. Neither depends on the range's own advice (MADV_RANDOM expert ranges are read
in the same large requests). Without POPULATE_READ (Linux < 5.14) one byte per page is touched instead.

Huge mode (huge=True: the caller reads the whole file, so reading past a range costs nothing): the whole mapping gets
MADV_HUGEPAGE and each piece is faulted in by MADV_POPULATE_READ alone, into 2 MiB page cache folios that mapping.py
maps by one page-table entry (fewer TLB misses). WILLNEED would read into 4 KiB folios, so it is left out (2026-12-01:
0.9x the WILLNEED rate, then 4-7% faster decode steps). Pages the page cache already held in smaller folios (another
program's reads) are mapped as they are, 4 KiB at a time; given `evict`, the page-in then finds those 2 MiB blocks
(mapping.small_page_blocks) and reads them again (_small_blocks). Not for part of a file: a fault near a range's end
would read up to 4 MiB past it, which no budget counted.

Only the given ranges are read (widened to whole pages); what the RAM budget allows is the caller's choice
(session.pagein_ranges). A PageIn runs in the caller's thread (run) or a background thread (start), with (done,
total) progress either way."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from streamer.mapping import MADV_POPULATE_READ, PAGE, madvise, mapped_bytes, small_page_blocks

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)

CHUNK = 8 * 2**20  # bytes waited for at a time (progress and stop granularity)
# bytes of reads queued past the piece being waited for: 128 MiB was no faster, and queued more in front of the
# forward pass's reads of the experts it needs
AHEAD = 32 * 2**20
MIN_STEP = 128 * 2**10  # the kernel's smallest readahead window (VM_READAHEAD_PAGES)


def readahead_bytes(path) -> int:
    """The most one MADV_WILLNEED reads of this file: Linux truncates a request to max(read_ahead_kb,
    max_sectors_kb) of the file's block device (force_page_cache_ra); what lies past that would be left to
    faults, and a fault outside MADV_RANDOM reads read_ahead_kb around itself, into neighbouring ranges.
    Not a block device (tmpfs, overlay) or unreadable: the kernel's minimum, 128 KiB."""
    try:
        st = os.stat(path)
        dev = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        queue = os.path.join(dev, "queue")
        if not os.path.isdir(queue):  # a partition: the queue is its disk's
            queue = os.path.join(os.path.dirname(dev), "queue")
        kb = [int(open(os.path.join(queue, f)).read()) for f in ("read_ahead_kb", "max_sectors_kb")]
        return max(MIN_STEP, max(kb) * 1024 // mmap.PAGESIZE * mmap.PAGESIZE)
    except (OSError, ValueError):
        return MIN_STEP


Progress = Callable[[int, int], None]


def pieces(ranges, chunk: int = CHUNK, limit: int | None = None, edges: set | None = None) -> list[tuple[int, int]]:
    """Whole-page (start, length) pieces of at most `chunk` bytes covering `ranges` ((offset, length) pairs)
    in their order. A range that starts inside or right at the end of the previous one (after widening to
    pages) extends it (tensors side by side become one read). Tensors share pages only at their edges: an edge
    page an earlier piece covers is not read again. limit: the size of the mapping. edges: the edge pages of
    pieces made before (updated), so ranges given later skip them too."""
    merged: list[list[int]] = []
    for start, n in ranges:
        if n <= 0:
            continue
        a = start // PAGE * PAGE
        b = -(-(start + n) // PAGE) * PAGE
        if limit is not None:
            b = min(b, limit)
        if merged and merged[-1][0] <= a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    edges = set() if edges is None else edges
    for a, b in merged:
        if a in edges:
            a += PAGE
        if b - PAGE in edges and b > a:
            b -= PAGE
        if b <= a:
            continue
        edges.update((a, b - PAGE))
        for s in range(a, b, chunk):
            out.append((s, min(chunk, b - s)))
    return out


class PageIn:
    """Reads `ranges` of the mapping `mm` (a uint8 array from mapping.map_files) into the page cache and maps
    them. `advise(mm, start, length, advice) -> errno` is mapping.madvise (tests pass a recorder). extend()
    appends ranges while it runs (or after it ended: a started page-in then goes on in a new thread), so
    the bytes every forward pass needs can be read before the rest of what the budget keeps is known."""

    def __init__(
        self,
        mm: np.ndarray,
        ranges,
        chunk: int = CHUNK,
        ahead: int = AHEAD,
        step: int = MIN_STEP,
        advise=madvise,
        huge: bool = False,
        evict: Callable[[int, int], None] | None = None,
    ):
        """step: bytes per MADV_WILLNEED call, at most what the kernel reads for one (readahead_bytes).
        huge: the ranges are the whole file (see the module's docstring); partial() if it turns out they are
        not. evict(start, length): drop those bytes' page cache (GGUFFile.drop_cached); in huge mode the blocks
        found mapped by 4 KiB pages after the last piece are then read again, into 2 MiB folios (_small_blocks)."""
        self.mm = mm
        self.huge = huge
        self.chunk = chunk
        self._edges: set = set()
        self.pieces = pieces(ranges, chunk, limit=mm.size, edges=self._edges)
        self.total = sum(n for _, n in self.pieces)
        self.ahead, self.step = ahead, max(PAGE, step // PAGE * PAGE)
        self.advise = advise
        self.evict = evict
        self._reread: set[int] = set()  # starts of the pieces that re-read small-folio blocks
        self.reread_bytes = 0  # their bytes (in total and done too)
        self._scanned = 0  # pieces when the mapping was last scanned for them
        self.done = 0
        self.seconds = 0.0  # time spent running (a page-in extended after it ended does not count the gap)
        self.ended: float | None = None  # perf_counter() when the last piece was mapped
        self.error: BaseException | None = None
        self._next = 0  # the piece to wait for next
        self._queued = 0  # pieces whose reads are queued
        self._queued_bytes = 0  # their bytes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._populate = True  # MADV_POPULATE_READ works here (cleared at its first failure)
        self._advised = False  # huge: MADV_HUGEPAGE given

    def partial(self) -> None:
        """The ranges are not the whole file after all (huge mode off): the mapping's MADV_HUGEPAGE is taken
        back, and the pieces still to read are queued with MADV_WILLNEED, reading no further than they go."""
        with self._lock:
            self.huge = False
            if self._advised:
                self.advise(self.mm, 0, self.mm.size, MADV_NOHUGEPAGE)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def gb_s(self) -> float:
        return self.done / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def extend(self, ranges) -> None:
        """Read `ranges` too, after those given so far."""
        with self._lock:
            new = pieces(ranges, self.chunk, limit=self.mm.size, edges=self._edges)
            if not new:
                return
            self.pieces.extend(new)
            self.total += sum(n for _, n in new)
            restart = self._finished.is_set() and self._thread is not None and not self._stop.is_set()
            if restart:
                self._finished.clear()
        if restart:  # the thread saw no more pieces and ended: go on in a new one
            self._thread.join()
            self.start()

    def run(self, progress: Progress | None = None) -> int:
        """Read every piece now, in order; returns the bytes paged in (all of them, unless stopped)."""
        t0 = time.perf_counter()
        base = self.seconds
        try:
            while True:
                with self._lock:
                    if self._next >= len(self.pieces) and self._scanned < len(self.pieces) and self.huge:
                        self._small_blocks()
                    if self._next >= len(self.pieces) or self._stop.is_set():
                        self._finished.set()  # under the lock: extend() sees either a piece taken or the end
                        break
                    start, n = self.pieces[self._next]
                    huge = self.huge
                    if huge and not self._advised:  # the whole mapping at once: a 2 MiB page must sit in one VMA
                        self.advise(self.mm, 0, self.mm.size, MADV_HUGEPAGE)
                        self._advised = True
                if huge:  # no WILLNEED (4 KiB folios): the faults read 2 MiB ones
                    self._queued, self._queued_bytes = self._next + 1, self.done + n
                # else queue this piece, and the next ones while they end at most `ahead` bytes past it
                while (
                    not huge
                    and self._queued < len(self.pieces)
                    and (
                        self._queued <= self._next
                        or self._queued_bytes + self.pieces[self._queued][1] - (self.done + n) <= self.ahead
                    )
                ):
                    s, m = self.pieces[self._queued]
                    for a in range(s, s + m, self.step):  # each call within what the kernel reads for one
                        self.advise(self.mm, a, min(self.step, s + m - a), mmap.MADV_WILLNEED)
                    self._queued += 1
                    self._queued_bytes += m
                if start in self._reread:  # unmapped here, so that the page cache can let the folios go
                    self.advise(self.mm, start, n, mmap.MADV_DONTNEED)
                    self.evict(start, n)
                self._map(start, n)
                self._next += 1
                self.done += n
                self.seconds = base + time.perf_counter() - t0
                if progress is not None:
                    progress(self.done, self.total)
        finally:
            self.seconds = base + time.perf_counter() - t0
            self.ended = time.perf_counter()
            self._finished.set()
        return self.done

    def mapped(self) -> int:
        """Bytes of the mapping in this process's RSS now (mapping.mapped_bytes; a 2 MiB folio is mapped whole, so
        this can exceed done), or done where the kernel cannot tell: what the budget's process share leaves out."""
        got = mapped_bytes(self.mm)
        return self.done if got is None else got

    def _small_blocks(self) -> None:
        """Huge mode, every piece read (under the lock): the 2 MiB blocks the page cache already held in smaller
        folios were mapped 4 KiB at a time. Each block not re-read before becomes a piece to read again, after its
        folios are evicted, so that the whole file is mapped by 2 MiB entries, as when it came from the disk.
        2026-12-07, the 30B-A3B (16.3 GiB) right after llama.cpp's run: 11.4-13.8 GiB mapped so without this, 15.8
        with it (2.2-3.1 GiB read again; the page-in's time within its spread). mapping.py's paired decode steps:
        4.0-4.9% faster with 11 of 17 GB in 2 MiB folios, 7.2% with 16 GB (2026-12-01)."""
        blocks = small_page_blocks(self.mm) if self.evict is not None and not self._stop.is_set() else None
        new = [(s, n) for s, n in pieces(blocks or (), self.chunk) if s not in self._reread]  # adjacent ones merged
        self._reread.update(s for s, _ in new)
        self.pieces.extend(new)
        self.reread_bytes += sum(n for _, n in new)
        self.total += sum(n for _, n in new)
        self._scanned = len(self.pieces)

    def _map(self, start: int, n: int) -> None:
        """Map the piece's pages (MADV_POPULATE_READ: waits for their reads), then read a byte of each page. On a VM
        whose memory went back to its host, the guest's first access to each page still costs an exit to the host;
        doing it here keeps that out of the first forward pass (2026-12-06: its prefill at 21 tok/s, 10 without)."""
        if self._populate:
            err = self.advise(self.mm, start, n, MADV_POPULATE_READ)
            if err != 0 and err != errno.EINVAL:  # EFAULT: the file shrank under us; the forward pass will say so
                raise OSError(err, os.strerror(err))
            if err == errno.EINVAL:
                self._populate = False  # a kernel without it: the reads below fault the pages in
        int(self.mm[start : start + n : PAGE].sum(dtype=np.uint64))

    def start(self) -> PageIn:
        """Run in a background (daemon) thread; stop() or wait() later."""

        def body():
            try:
                self.run()
            except BaseException as e:  # a hint only: the forward pass faults the pages in itself
                self.error = e

        self._thread = threading.Thread(target=body, name="stream-run page-in", daemon=True)
        self._thread.start()
        return self

    def wait(self, progress: Progress | None = None, poll_s: float = 0.25) -> int:
        """Block until the background run finishes, reporting progress meanwhile."""
        while not self._finished.wait(poll_s):
            if progress is not None:
                progress(self.done, self.total)
        if progress is not None:
            progress(self.done, self.total)
        if self._thread is not None:
            self._thread.join()
        return self.done

    def stop(self) -> None:
        """Stop after the piece being read (at most `chunk` bytes) and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
