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
import fcntl
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


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg (linux/fs.h)
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages")
        + ("category_inverted", "category_mask", "category_anyof_mask", "return_mask")
    ]


class _PageRegion(ctypes.Structure):  # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_PAGE_IS_FILE, _PAGE_IS_PRESENT, _PAGE_IS_HUGE = 1 << 2, 1 << 3, 1 << 6  # linux/fs.h
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, pm_scan_arg)


def _scan(arr: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(start, end, categories) runs of arr's pages, relative to arr, by the kernel's PAGEMAP_SCAN of this process's
    page tables (Linux 6.7+; None without it); categories: present, a file's, mapped by a 2 MiB entry."""
    base, size = arr.ctypes.data, arr.size
    n = 4096
    vec = (_PageRegion * n)()
    out = []
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        at = base
        while at < base + size:
            a = _ScanArg(size=ctypes.sizeof(_ScanArg), start=at, end=base + size, vec=ctypes.addressof(vec))
            a.vec_len, a.return_mask = n, _PAGE_IS_PRESENT | _PAGE_IS_FILE | _PAGE_IS_HUGE
            got = fcntl.ioctl(fd, _PAGEMAP_SCAN, a)
            out += [(r.start - base, r.end - base, r.categories) for r in vec[:got]]
            if a.walk_end <= at:
                break
            at = a.walk_end
    except OSError:  # ENOTTY or EINVAL: no PAGEMAP_SCAN
        return None
    finally:
        os.close(fd)
    return out


def mapped_bytes(arr: np.ndarray) -> int | None:
    """Bytes of arr's pages mapped in this process now (in its RSS): a 2 MiB page cache folio is mapped whole, so
    this can exceed the bytes asked for. None where the kernel cannot tell (PAGEMAP_SCAN)."""
    runs = _scan(arr)
    return None if runs is None else sum(e - s for s, e, c in runs if c & _PAGE_IS_PRESENT)


def small_page_blocks(arr: np.ndarray) -> list[tuple[int, int]] | None:
    """The ALIGN blocks (start, ALIGN) of an array from map_files (which starts at an ALIGN boundary) whose pages
    are all mapped and none by a 2 MiB entry: page cache folios smaller than 2 MiB, mapped 4 KiB at a
    time (a file's pages only, never anonymous memory such as a copy). None where the kernel cannot tell
    (PAGEMAP_SCAN: Linux 6.7+). A block the file ends inside, or with a page not mapped, is left out."""
    runs = _scan(arr) if arr.ctypes.data % ALIGN == 0 else None
    if runs is None:
        return None
    counts = np.zeros(-(-arr.size // ALIGN), np.int64)  # per block: bytes present in small pages
    for s, e, c in runs:
        if c == _PAGE_IS_PRESENT | _PAGE_IS_FILE:  # a file's page, mapped, not huge
            while s < e:  # split at block edges
                t = min(e, (s // ALIGN + 1) * ALIGN)
                counts[s // ALIGN] += t - s
                s = t
    return [(b * ALIGN, ALIGN) for b in np.flatnonzero(counts == ALIGN).tolist()]
