"""Fault in the expert cache's never-used slots ahead of need, on otherwise idle CPU.

A slot's first read faults in and zeroes its pages inside the O_DIRECT read (experts/cache.py), on the path of the
token that waits for it (2026-12-04: 1.7 s of CPU per GB on a VM whose host backs a page only when first touched).
Two threads pay it beforehand: MADV_POPULATE_WRITE 2 MiB at a time, from the lowest never-used slot up (the next
ones the cache will take; each slot size's range in turn), at SCHED_IDLE, so they run only on a CPU nothing else
wants. Populating a page that is already there changes nothing, so racing a read into the same slot is harmless,
and the cache's choices never depend on it, so replay still equals the live run.

It starts when its owner calls start(): the MoE layer does so after the session's first layer call, not at
start-up, whose own work that maps or touches new memory (numba loading cached kernels, the madvise of the expert
ranges) it would slow down."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

from streamer.mapping import madvise

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
CHUNK = 2 * 2**20


# Threads faulting pages in: the host backs both vCPUs' faults at once (2026-12-06: two threads 1.4-1.9x one).
# At SCHED_IDLE they only take CPU time nothing else wants.
THREADS = 2


class Prefaulter:
    def __init__(self, arena: np.ndarray, todo: Callable[[], list[tuple[int, int]] | None], threads: int = THREADS):
        """arena: the cache's bytes (uint8, 1-D); todo(): the byte ranges of its never-used slots (one per slot
        size), None once the cache is gone. The threads hold neither: a cache dropped without closing is freed,
        not faulted in. They take 2 MiB chunks in turn from one cursor."""
        self.arena, self.todo = weakref.ref(arena), todo
        self._stop = threading.Event()
        self.done = threading.Event()  # set once every thread has ended
        self.error = 0  # the errno that stopped it early (0: none)
        self.threads = [
            threading.Thread(target=self._run, daemon=True, name=f"arena-prefault-{i}") for i in range(threads)
        ]
        self.thread = self.threads[0]
        self._lock = threading.Lock()  # start() and stop() in either order, from any thread
        self._cursor = threading.Lock()  # the chunks handed out: per range (by its end) how far, and whose turn
        self._reached: dict[int, int] = {}
        self._turn = 0
        self._running = threads

    @property
    def started(self) -> bool:
        return self.thread.ident is not None

    def start(self) -> Prefaulter:
        """Start the threads (once; not after stop())."""
        with self._lock:
            if not self.started and not self._stop.is_set():
                for t in self.threads:
                    t.start()
        return self

    def _claim(self):
        """The next chunk to fault in, (arena, start, length), taking the ranges in turn; None when there is none
        or the prefaulter is stopping."""
        with self._cursor:
            if self._stop.is_set():
                return None
            arena, todo = self.arena(), self.todo()
            if arena is None or todo is None:
                return None
            left = [(max(start, self._reached.get(end, 0)), end) for start, end in todo]
            left = [(start, end) for start, end in left if start < end]
            if not left:
                return None
            start, end = left[self._turn % len(left)]
            self._turn += 1
            self._reached[end] = start + CHUNK
            return arena, start, min(CHUNK, end - start)

    def faulted(self, end: int) -> int | None:
        """How far the never-used range ending at `end` is faulted in: the chunks handed out, less one per
        thread that may still be at work on its chunk (all of it once every thread has ended). None when it
        stopped early on an error: its pages are no longer being faulted in ahead of need."""
        if self.error:
            return None
        if self.done.is_set():
            return end
        with self._cursor:
            return self._reached.get(end, 0) - CHUNK * len(self.threads)

    def _run(self) -> None:
        try:
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            while (job := self._claim()) is not None:
                err = madvise(*job, MADV_POPULATE_WRITE)
                del job
                if err:  # no POPULATE_WRITE here, or no memory: the reads fault the pages in as before
                    self.error = err
                    self._stop.set()
        finally:
            with self._cursor:
                self._running -= 1
                if self._running == 0:
                    self.done.set()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            if not self.started:  # never ran: nothing to wait for
                self.done.set()
