"""Where each expert's bytes are in the file, and reading them with explicit preads that bypass the page cache.

Expert e of `blk.L.ffn_{gate,up,down}_exps.weight` is one contiguous slab of each tensor, so an expert is
three reads (files converted with gate and up merged, `ffn_gate_up_exps`, hold expert e's gate rows and then its
up rows as one slab: two parts of one tensor, each read apart). With O_DIRECT the reads are widened to 4 KiB boundaries into 4 KiB-aligned buffers (< 1%
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

from streamer.buffers import ALIGN, open_direct
from streamer.errors import StreamerError


@dataclass(frozen=True)
class Part:
    """One of gate/up/down of every expert of a layer: expert e's nbytes start at offset + e * stride (stride is
    nbytes, or twice it for the halves of a merged gate_up tensor), rows row0 .. row0 + n_rows of the tensor's
    slab of that expert."""

    name: str
    offset: int
    nbytes: int
    stride: int
    qtype: object
    n_rows: int
    n_in: int
    shard: int = 0  # the file of a split model holding it; offset - that file's base is its offset in the file
    row0: int = 0


def merged_gate_up(gf, layer: int) -> str | None:
    """The name of the layer's merged gate_up expert tensor, if the file has one instead of gate and up."""
    name = f"blk.{layer}.ffn_gate_up_exps.weight"
    return name if name in gf.tensors else None


def expert_parts(gf, layer: int, n_expert: int) -> tuple[Part, Part, Part]:
    """Where gate, up and down of the layer's experts are (each tensor's slab of expert e: its bytes / n_expert)."""

    def part(name: str, half: int = -1) -> Part:
        t = gf.tensors[name]
        stride = t.nbytes // n_expert
        if half < 0:
            return Part(t.name, t.offset, stride, stride, t.qtype, t.shape[1], t.shape[2], t.shard)
        rows = t.shape[1] // 2  # gate rows, then up rows
        return Part(t.name, t.offset + half * stride // 2, stride // 2, stride, t.qtype, rows, t.shape[2], t.shard,
                    half * rows)  # fmt: skip

    merged = merged_gate_up(gf, layer)
    down = part(f"blk.{layer}.ffn_down_exps.weight")
    if merged is not None:
        return part(merged, 0), part(merged, 1), down
    return part(f"blk.{layer}.ffn_gate_exps.weight"), part(f"blk.{layer}.ffn_up_exps.weight"), down


def aligned_span(start: int, nbytes: int) -> tuple[int, int, int]:
    """(aligned file offset, aligned length, offset of the data inside the span)."""
    a0 = start // ALIGN * ALIGN
    a1 = -(-(start + nbytes) // ALIGN) * ALIGN
    return a0, a1 - a0, start - a0


class ExpertLayout:
    def __init__(self, gf, cfg):
        self.n_layer, self.n_expert = cfg.n_layer, cfg.n_expert
        self.parts: list[tuple[Part, ...]] = [expert_parts(gf, i, cfg.n_expert) for i in range(cfg.n_layer)]
        # a slot holds any expert of its layer: a part of n bytes spans at most ceil((n + 4095) / 4096) pages
        self.layer_slot_bytes = [sum(-(-(p.nbytes + ALIGN - 1) // ALIGN) * ALIGN for p in ps) for ps in self.parts]
        self.slot_bytes = max(self.layer_slot_bytes)  # one that holds any expert

    def expert_bytes(self, layer: int) -> int:
        return sum(p.nbytes for p in self.parts[layer])

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(i) for i in range(self.n_layer)) * self.n_expert


class ExpertReader:
    """Reads one expert's three parts into a caller-owned buffer; returns each part's offset in it. A split
    model's shards each get their own descriptors: a part is read from the file that holds it, at its offset
    in that file (its offset in the shared mapping minus the file's base there)."""

    def __init__(self, files: list[tuple[str, int]], layout: ExpertLayout, direct: bool | None = None):
        """files: (path, base in the mapping) of each file of the model, as GGUFFile.shards gives them."""
        self.layout = layout
        self.paths = [p for p, _ in files]
        self.bases = [b for _, b in files]
        self.path = self.paths[0]
        self.fds: list[int] = []
        self.dfds: list[int] = []
        self.direct = False
        try:
            if direct is not False and hasattr(os, "O_DIRECT"):
                self.direct = self._try_direct()
            if direct is True and not self.direct:
                raise StreamerError(f"{self.path}: the filesystem refuses O_DIRECT reads (try --io buffered)")
            for p in self.paths:
                self.fds.append(os.open(p, os.O_RDONLY))
                os.posix_fadvise(self.fds[-1], 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into other experts
        except BaseException:
            self.close()
            raise

    def _try_direct(self) -> bool:
        """O_DIRECT descriptors on every file, or none (a file that refuses them: buffered reads for all)."""
        for p in self.paths:
            fd = open_direct(p)
            if fd < 0:
                break
            self.dfds.append(fd)
        else:
            return True
        for fd in self.dfds:
            os.close(fd)
        self.dfds = []
        return False

    def read(self, layer: int, e: int, buf: np.ndarray) -> tuple[int, int, int]:
        """Fill buf (aligned, >= slot_bytes) with expert (layer, e); offsets of gate, up, down inside buf."""
        mv = memoryview(buf)
        pos, offs = 0, []
        for p in self.layout.parts[layer]:
            start = p.offset - self.bases[p.shard] + e * p.stride  # in the file holding it
            try:
                if self.direct:
                    a0, alen, inner = aligned_span(start, p.nbytes)
                    got = os.preadv(self.dfds[p.shard], [mv[pos : pos + alen]], a0)
                    offs.append(pos + inner)
                    pos += alen
                    need = inner + p.nbytes
                else:
                    fd = self.fds[p.shard]
                    got = os.preadv(fd, [mv[pos : pos + p.nbytes]], start)
                    a0, alen, _ = aligned_span(start, p.nbytes)  # whole pages, edges included
                    os.posix_fadvise(fd, a0, alen, os.POSIX_FADV_DONTNEED)
                    offs.append(pos)
                    pos += -(-p.nbytes // ALIGN) * ALIGN
                    need = p.nbytes
            except OSError as err:
                raise StreamerError(f"I/O error reading expert {e} of {p.name}: {err.strerror or err}") from None
            if got < need:
                raise StreamerError(f"{self.paths[p.shard]}: short read of expert {e} of {p.name} (file truncated?)")
        return offs[0], offs[1], offs[2]

    def close(self) -> None:
        for fd in self.fds + self.dfds:
            os.close(fd)
        self.fds, self.dfds = [], []


class ReaderPool:
    """A few threads running read jobs; demand reads (priority 0) go before prefetches (priority 1),
    first come first served within a priority. pread releases the GIL, so reads overlap compute."""

    def __init__(self, n_threads: int = 4):
        self.q: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.threads = [
            threading.Thread(target=self._work, daemon=True, name=f"expert-reader-{i}") for i in range(n_threads)
        ]
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
