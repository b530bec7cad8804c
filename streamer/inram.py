"""--no-mmap: the model's bytes read into the process's own memory, as llama.cpp's --no-mmap does, instead of used in
place from the file's page cache pages.

The copy has the mapping's layout (each shard at the same base), so every tensor view, expert offset and kernel is
unchanged and the logits are the same bits. It is anonymous memory in 4 KiB pages (buffers.arena_empty). The reads are
O_DIRECT (--io auto or direct), so the page cache does not hold a second copy; with --io buffered, or where the
filesystem refuses O_DIRECT, plain reads drop the pages behind them (POSIX_FADV_DONTNEED). The last bytes of a file past
its last 4 KiB boundary are read plainly. On a VM, faulting fresh memory in costs more than the disk, so READERS threads
each fault a CHUNK in (MADV_POPULATE_WRITE) and then read it (2026-12-02: 1.42 GB/s, against 0.67 for one thread
reading into unfaulted memory).

Why at all: on a VM, decode steps reading the page cache's pages stalled in stretches where the same bytes in
anonymous memory did not (bench/RESULTS.md, 2026-12-02). The price is reading the whole file at every load."""

from __future__ import annotations

import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from streamer.buffers import ALIGN, arena_empty, open_direct
from streamer.errors import StreamerError
from streamer.mapping import madvise

CHUNK = 64 * 2**20  # bytes per read
READERS = 2
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the pages in now (an error elsewhere: the read faults them)


def read_into_memory(shards, size: int, direct: bool | None = None, progress=None) -> np.ndarray:
    """A uint8 array of `size` bytes holding each shard's file at its base. shards: (path, base, nbytes) per
    file; direct: True O_DIRECT (an error if refused), False plain reads, None O_DIRECT where allowed.
    progress(done, total) after every read."""
    out = arena_empty(size, "the model (--no-mmap)")
    fds: list[int] = []
    try:
        jobs = []  # (descriptor, plain, path, offset in the file, bytes, offset in out)
        for path, base, n in shards:
            fd, dfd = _open(path, direct, fds)
            aligned = n // ALIGN * ALIGN if dfd >= 0 else 0
            jobs += [(dfd, False, path, at, min(CHUNK, aligned - at), base + at) for at in range(0, aligned, CHUNK)]
            jobs += [(fd, True, path, at, min(CHUNK, n - at), base + at) for at in range(aligned, n, CHUNK)]
        total = sum(n for _, _, n in shards)
        mv = memoryview(out)
        with ThreadPoolExecutor(READERS, thread_name_prefix="stream-run no-mmap") as pool:
            pending = {pool.submit(_read, out, mv, *job) for job in jobs}
            done = 0
            try:
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for f in finished:
                        done += f.result()  # the first error is raised here
                        if progress is not None:
                            progress(done, total)
            except BaseException:  # an error or Ctrl-C: the reads not started are dropped, running ones end
                for f in pending:
                    f.cancel()
                raise
        return out
    finally:
        for fd in fds:
            os.close(fd)


def _open(path: str, direct: bool | None, fds: list[int]) -> tuple[int, int]:
    """(plain descriptor, O_DIRECT descriptor or -1), both appended to fds."""
    fd = os.open(path, os.O_RDONLY)
    fds.append(fd)
    dfd = open_direct(path) if direct is not False else -1
    if dfd >= 0:
        fds.append(dfd)
    if direct is True and dfd < 0:
        raise StreamerError(f"{path}: the filesystem refuses O_DIRECT reads (try --io buffered)")
    return fd, dfd


def _read(out: np.ndarray, mv: memoryview, fd: int, plain: bool, path: str, at: int, n: int, dst: int) -> int:
    madvise(out, dst, n, MADV_POPULATE_WRITE)
    got = 0
    while got < n:
        try:
            k = os.preadv(fd, [mv[dst + got : dst + n]], at + got)
        except OSError as e:
            raise StreamerError(f"I/O error reading {path}: {e.strerror or e}") from None
        if k <= 0:
            raise StreamerError(f"{path}: short read at byte {at + got} (file truncated?)")
        got += k
    if plain:
        os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)
    return n
