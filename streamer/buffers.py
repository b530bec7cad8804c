"""Buffers and descriptors for reading files around the page cache: 4 KiB-aligned buffers, O_DIRECT
descriptors, and the anonymous arena the expert cache (and --no-mmap's copy of the model) live in."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

ALIGN = 4096  # O_DIRECT's alignment of buffers, offsets and lengths


def open_direct(path: str) -> int:
    """An O_DIRECT descriptor on path, or -1 where it is refused: at the open, or (EINVAL on some filesystems)
    at a first aligned read."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return -1
    try:
        os.preadv(fd, [memoryview(aligned_empty(ALIGN))], 0)
    except OSError:
        os.close(fd)
        return -1
    return fd


def aligned_empty(nbytes: int) -> np.ndarray:
    """Uninitialised uint8 buffer whose data pointer is 4 KiB aligned (O_DIRECT needs it)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip : skip + nbytes]


def arena_empty(nbytes: int, what: str = "the expert cache") -> np.ndarray:
    """A uint8 buffer for the expert cache's arena: a private anonymous mapping (page-aligned, as O_DIRECT wants;
    zero pages until written) advised MADV_NOHUGEPAGE, so it is faulted in 4 KiB pages. numpy advises 2 MiB pages
    for an array this large, and a 2 MiB page is zeroed whole at its first fault: on a VM whose free memory the
    host has taken back, slower than the disk (bench/arena_pages.py). The price: more TLB misses in the decode
    kernels reading experts from it (0-11%). `what` names the buffer in the error. --no-mmap's copy of the model
    uses it too (inram.py)."""
    try:
        m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)  # not Python's default MAP_SHARED (tmpfs pages)
    except OSError as e:  # as np.empty would: the CLI's one line for MemoryError suggests a smaller budget
        if e.errno == errno.ENOMEM:
            raise MemoryError(f"cannot map {nbytes} bytes for {what}") from None
        raise
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        m.madvise(advice)
    return np.frombuffer(m, np.uint8)[:nbytes]
