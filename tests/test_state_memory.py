"""A sequence's K/V rows in memory: zeroed mappings the kernel fills in 4 KiB pages as positions are written,
never 2 MiB ones (a fresh state's first prefill would otherwise zero 2 MiB per head and layer). What is mapped
how is asked of the kernel (/proc/self/smaps)."""

import os

import numpy as np
import pytest
from procfs import vma_fields

from streamer.state import KVRows

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")


def test_kv_rows_are_zeroed_small_page_mappings():
    kv = KVRows(4, 8192, 128)  # 8 MiB per array: numpy would ask for huge pages
    for a in (kv.k, kv.v):
        assert a.shape == (4, 8192, 128) and a.dtype == np.uint16
        assert a.flags.c_contiguous and a.flags.writeable and not a.any()
        (vma,) = vma_fields(a.ctypes.data, a.nbytes)
        assert "nh" in vma["VmFlags"].split()  # MADV_NOHUGEPAGE
    assert kv.nbytes == 2 * 4 * 8192 * 128 * 2


def test_a_prefill_commits_only_the_rows_it_writes():
    kv = KVRows(4, 8192, 128)
    kv.k[:, :32] = 1  # a 32-token prefill's rows in every head: 8 KiB each
    (vma,) = vma_fields(kv.k.ctypes.data, kv.k.nbytes)
    assert vma["AnonHugePages"].split()[0] == "0"
    assert int(vma["Rss"].split()[0]) <= 4 * 16  # kB: two or three 4 KiB pages per head, not 2 MiB
    assert int(kv.k.sum()) == 4 * 32 * 128 and not kv.v.any()
