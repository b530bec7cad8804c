"""Read-only mappings of one or more files, side by side in one reserved address range.

A split GGUF is N files. Each is mapped on its own (read-only, shared, from its own descriptor), but all of them land
back to back, each at a page boundary, inside one range reserved first with PROT_NONE. So one numpy uint8 array spans
every shard and a tensor is a byte offset into it, whichever file holds it: the multi-expert kernels take one base array
and a byte offset per matrix, and a layer's gate, up and down may sit in different shards. The pages are the files' own
page cache pages, exactly as with np.memmap (a file truncated under us raises SIGBUS on its pages, as before). Linux
only, like the O_DIRECT expert reads.

Each file starts at a 2 MiB-aligned address (ALIGN), as the kernel places a plain mmap of a large file, so page cache
folios of 2 MiB (ext4, XFS; pagein.py's whole-file page-in) are mapped whole by one page-table entry each, instead of
512 of 4 KiB: fewer TLB misses (bench/mapping_ab.py: a decode step 4-7% faster)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE = 0, 0x10, 0x4000
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+: fault pages in (and map them) now
PAGE = mmap.PAGESIZE
ALIGN = 2 * 2**20  # where each file starts in the range: a PMD (huge page) boundary


class _Region:
    """Owns the reserved range; numpy arrays over it keep it alive (it is their base) and unmap it at the end."""

    def __init__(self, addr: int, length: int):
        self.addr, self.length = addr, length
        self.__array_interface__ = {"data": (addr, True), "shape": (length,), "typestr": "|u1", "version": 3}

    def __del__(self):
        _libc.munmap(self.addr, self.length)


def span(size: int) -> int:
    """Bytes a file of `size` bytes takes in the range: whole ALIGN units (the next file starts aligned)."""
    return -(-size // ALIGN) * ALIGN


def map_files(fds: list[int], sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """(read-only uint8 array over all files, byte offset of each file in it; each file starts at an
    ALIGN-aligned address). Raises OSError."""
    total = sum(span(s) for s in sizes)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    addr = _libc.mmap(None, total + ALIGN, _PROT_NONE, flags, -1, 0)  # room to slide to an aligned start
    if addr in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    region = _Region(addr, total + ALIGN)  # unmapped when the last array over it goes, or right away on an error
    lead = -addr % ALIGN  # unused bytes before the first file
    bases, at = [], 0
    for fd, size in zip(fds, sizes):
        got = _libc.mmap(addr + lead + at, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != addr + lead + at:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        bases.append(at)
        at += span(size)
    end = bases[-1] + -(-sizes[-1] // PAGE) * PAGE if sizes else 0  # the last file's last page: no aligning tail
    return np.asarray(region)[lead : lead + end], bases


def madvise(arr: np.ndarray, start: int, length: int, advice: int) -> int:
    """madvise bytes [start, start + length) of an array from map_files (widened to whole pages). Returns 0,
    or the errno (callers that only hint ignore it; MADV_POPULATE_READ's caller falls back on an error).
    ctypes drops the GIL for the call, so a blocking advice (POPULATE_READ) lets other threads run."""
    a0 = start // PAGE * PAGE
    end = min(start + length, arr.size)
    if end > a0 and _libc.madvise(arr.ctypes.data + a0, end - a0, advice) != 0:
        return ctypes.get_errno() or -1
    return 0
