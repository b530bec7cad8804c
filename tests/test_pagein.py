"""Page-in (streamer/pagein.py): the right byte ranges come into the page cache, in large queued reads, and
nothing beyond what the RAM budget keeps resident. Which bytes are cached is asked of the kernel (mincore);
which tensors are experts, of gguf-py's own parser. No timing here."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from procfs import vma_fields

from streamer.budget import resolve as resolve_budget
from streamer.gguf_file import GGUFFile
from streamer.mapping import MADV_POPULATE_READ, PAGE, madvise, map_files, small_page_blocks
from streamer.options import StreamOptions
from streamer.pagein import MADV_HUGEPAGE, MADV_NOHUGEPAGE, PageIn, pieces, readahead_bytes
from streamer.session import open_model, pagein_ranges

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cgroup  # noqa: E402  (bench/cgroup.py: evict, cached_bytes)

MiB = 2**20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_pages(arr: np.ndarray) -> np.ndarray:
    """Per page of a page-aligned mapped array: is it in the page cache (the kernel's mincore)."""
    n = -(-arr.size // PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert _libc.mincore(arr.ctypes.data, arr.size, vec) == 0, os.strerror(ctypes.get_errno())
    return np.frombuffer(vec, np.uint8) & 1 == 1


def evicted(path) -> bool:
    """Drop the file from the page cache (bench/cgroup.py's evict and mincore count); False where the
    filesystem keeps it (tmpfs)."""
    cgroup.evict(path)
    return cgroup.cached_bytes(path) == 0


def test_pieces_widen_merge_split_in_order():
    P = PAGE
    got = pieces([(5 * P + 10, 10), (3 * P, 2 * P + 1), (20 * P, 0), (40 * P, 9 * P), (0, 1)], chunk=4 * P)
    # 5P+10..5P+20 -> page 5; then 3P..5P+1 -> pages 3-4 (page 5, an earlier piece's edge, is not read
    # twice); a zero-length range is nothing; 40P..49P in chunks of 4 pages; then page 0
    assert got == [(5 * P, P), (3 * P, 2 * P), (40 * P, 4 * P), (44 * P, 4 * P), (48 * P, P), (0, P)]
    assert pieces([(0, 10 * P)], chunk=4 * P, limit=6 * P) == [(0, 4 * P), (4 * P, 2 * P)]
    assert pieces([(0, P), (P, P), (2 * P - 1, 2)], chunk=8 * P) == [(0, 3 * P)]  # touching ranges merge


def _recorded(**kw):
    """(PageIn over 64 pages of two ranges, in pieces of 4 pages, 8 ahead, WILLNEED steps of 3, its advice calls
    recorded as (advice, start, length); the list; the ranges)."""
    calls = []

    def advise(mm, start, n, advice):
        calls.append((advice, start, n))
        return 0

    ranges = [(0, 10 * PAGE), (30 * PAGE, 20 * PAGE)]
    mm = np.zeros(64 * PAGE, np.uint8)
    return PageIn(mm, ranges, chunk=4 * PAGE, ahead=8 * PAGE, step=3 * PAGE, advise=advise, **kw), calls, ranges


def test_reads_are_queued_ahead_then_waited_for_in_order():
    p, calls, ranges = _recorded()
    progress = []
    assert p.run(lambda done, total: progress.append((done, total))) == p.total == 30 * PAGE
    want = pieces(ranges, 4 * PAGE)
    queued = [(s, n) for a, s, n in calls if a == mmap.MADV_WILLNEED]
    populated = [(s, n) for a, s, n in calls if a == MADV_POPULATE_READ]
    assert populated == want  # every piece waited for once, in the given order
    # WILLNEED in steps of at most 3 pages (what the kernel reads for one call), covering each piece exactly
    assert queued == [(a, min(3 * PAGE, s + n - a)) for s, n in want for a in range(s, s + n, 3 * PAGE)]
    done = 0
    for i, c in enumerate(calls):
        if c[0] != MADV_POPULATE_READ:
            continue
        n = c[2]
        queued_bytes = sum(m for a, _, m in calls[:i] if a == mmap.MADV_WILLNEED)
        # all of this piece queued before it is waited for; the next ones up to `ahead` bytes past it
        assert done + n <= queued_bytes <= done + n + 8 * PAGE
        assert queued_bytes >= min(done + n + 8 * PAGE - 4 * PAGE, p.total)
        done += n
    assert [d for d, _ in progress] == list(np.cumsum([n for _, n in want]))
    assert progress[-1] == (p.total, p.total) and p.finished


def test_huge_mode_advises_the_whole_mapping_once_and_only_populates():
    p, calls, ranges = _recorded(huge=True)
    mm = p.mm
    assert p.run() == p.total == 30 * PAGE
    # MADV_HUGEPAGE over the whole mapping before the first read (a 2 MiB page maps whole only inside one
    # VMA), then each piece faulted in, in order: no WILLNEED (it reads into 4 KiB folios)
    assert calls == [(MADV_HUGEPAGE, 0, mm.size)] + [(MADV_POPULATE_READ, s, n) for s, n in pieces(ranges, 4 * PAGE)]
    # not the whole file after all: the advice is taken back, and what is added is queued as without huge
    calls.clear()
    p.partial()
    p.extend([(56 * PAGE, 4 * PAGE)])
    p.run()
    assert calls == [(MADV_NOHUGEPAGE, 0, mm.size), (mmap.MADV_WILLNEED, 56 * PAGE, 3 * PAGE)] + [
        (mmap.MADV_WILLNEED, 59 * PAGE, PAGE),
        (MADV_POPULATE_READ, 56 * PAGE, 4 * PAGE),
    ]
    assert not p.huge and p.done == p.total == 34 * PAGE


def _pmd_mapped(addr: int, size: int) -> int:
    """Bytes of [addr, addr + size) mapped by 2 MiB page-table entries (FilePmdMapped of its VMAs)."""
    return sum(int(v["FilePmdMapped"].split()[0]) * 1024 for v in vma_fields(addr, size) if "FilePmdMapped" in v)


def _cold_mapped(path, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(random bytes written to path, evicted from the page cache, and map_files' mapping of it); skips where
    the filesystem keeps files in the page cache."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    if not evicted(path):
        pytest.skip("this filesystem keeps files in the page cache (tmpfs): nothing to page in")
    fd = os.open(path, os.O_RDONLY)
    mm, _ = map_files([fd], [data.size])
    os.close(fd)
    return data, mm


def _skip_without_2mib_file_pages(path) -> None:
    """Skip where the kernel maps no 2 MiB pages of this filesystem's files (THP off, or no large folios): a plain
    mmap of the file, evicted, advised MADV_HUGEPAGE and faulted in, tells."""
    cgroup.evict(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as plain:
        view = np.frombuffer(plain, np.uint8)
        madvise(view, 0, view.size, MADV_HUGEPAGE)
        madvise(view, 0, view.size, MADV_POPULATE_READ)
        control = _pmd_mapped(view.ctypes.data, view.size)
        del view
    if control == 0:
        pytest.skip("the kernel maps no 2 MiB pages of this filesystem's files (THP off, or no large folios)")


def test_a_huge_pagein_maps_the_file_by_2mib_pages(tmp_path):
    path = tmp_path / "blob"
    data, mm = _cold_mapped(path, 24 * MiB + 3 * PAGE, 1)
    madvise(mm, 0, mm.size, mmap.MADV_RANDOM)  # as expert ranges are: huge mode reads them in 2 MiB pages too
    p = PageIn(mm, [(0, data.size)], huge=True)
    p.run()
    assert resident_pages(mm).all() and np.array_equal(mm, data)
    got = _pmd_mapped(mm.ctypes.data, mm.size)
    if got == 0:
        _skip_without_2mib_file_pages(path)
    assert got >= 20 * MiB  # all but the 2 MiB pages at the file's end


def test_a_huge_pagein_reads_blocks_cached_in_small_folios_again(tmp_path):
    """A file the page cache holds in 4 KiB folios (faults under MADV_RANDOM read so; another program's reads can
    leave a model so) is mapped 4 KiB at a time, whatever the advice. Given evict, the huge page-in finds those blocks
    (the kernel's PAGEMAP_SCAN) and reads them again into 2 MiB folios: smaps then counts them as 2 MiB mappings,
    the bytes unchanged, and its progress counts the bytes read again."""
    path = tmp_path / "blob"
    data, mm = _cold_mapped(path, 24 * MiB + 3 * PAGE, 2)
    madvise(mm, 0, mm.size, mmap.MADV_RANDOM)  # each fault reads its own 4 KiB page, into a 4 KiB folio
    madvise(mm, 0, mm.size, MADV_POPULATE_READ)
    PageIn(mm, [(0, data.size)], huge=True).run()  # no evict: mapped as they are
    if small_page_blocks(mm) is None:
        pytest.skip("no PAGEMAP_SCAN in this kernel (Linux < 6.7)")
    if _pmd_mapped(mm.ctypes.data, mm.size) > 0:
        pytest.skip("this kernel read the faults into large folios: no small ones to find")
    assert small_page_blocks(mm) == [(b * 2 * MiB, 2 * MiB) for b in range(12)]  # not the file's last 3 pages

    def evict(start, n):
        evicted_ranges.append((start, n))
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    evicted_ranges: list = []
    progress: list = []
    p = PageIn(mm, [(0, data.size)], huge=True, evict=evict)
    p.run(lambda d, t: progress.append((d, t)))
    assert evicted_ranges == pieces([(0, 24 * MiB)])  # each block once, in CHUNK pieces
    assert p.done == p.total == data.size + 24 * MiB and p.reread_bytes == 24 * MiB  # the file, then 12 blocks
    assert progress[-1] == (p.total, p.total)
    assert np.array_equal(mm, data) and resident_pages(mm).all()
    got = _pmd_mapped(mm.ctypes.data, mm.size)
    if got == 0:
        _skip_without_2mib_file_pages(path)
    assert got == 24 * MiB and small_page_blocks(mm) == []


@pytest.mark.parametrize(
    "populate,advice",
    [
        (True, mmap.MADV_RANDOM),  # as expert ranges are: a fault never reads its neighbours ahead
        (False, mmap.MADV_RANDOM),  # a kernel without MADV_POPULATE_READ: pages are touched
        (True, mmap.MADV_NORMAL),  # as non-expert ranges are: a fault would read read_ahead_kb around itself
    ],
)
def test_exactly_the_ranges_come_into_the_page_cache(tmp_path, populate, advice):
    path = tmp_path / "blob"
    data, mm = _cold_mapped(path, 48 * MiB, 0)
    madvise(mm, 0, mm.size, advice)

    def advise(arr, start, n, what):
        return errno.EINVAL if what == MADV_POPULATE_READ and not populate else madvise(arr, start, n, what)

    # pieces larger than one WILLNEED the kernel honours (8 MiB here with read_ahead_kb 8192): every page
    # must still be queued, or the populate faults read around themselves
    ranges = [(20 * MiB + 100, 11 * MiB), (2 * MiB, 3 * MiB + 5)]
    p = PageIn(mm, ranges, chunk=16 * MiB, ahead=32 * MiB, step=readahead_bytes(path), advise=advise)
    p.run()
    want = np.zeros(mm.size // PAGE, bool)
    for s, n in ranges:
        want[s // PAGE : -(-(s + n) // PAGE)] = True
    got = resident_pages(mm)
    assert got[want].all(), "a page of the ranges is not in the page cache"
    assert not got[~want].any(), f"{int(got[~want].sum())} pages outside the ranges were read"
    assert p.done == int(want.sum()) * PAGE
    assert np.array_equal(mm[21 * MiB : 31 * MiB], data[21 * MiB : 31 * MiB])  # the file's bytes, mapped


def _tensors(path):
    """(offset in the file, bytes, is an expert, is the embedding table and not also the output head) of every
    tensor, from gguf-py's parser."""
    ts = GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in ts)
    return [
        (int(t.data_offset), int(t.n_bytes), "_exps." in t.name, untied and t.name == "token_embd.weight") for t in ts
    ]


def _covered(ranges) -> set:
    return {pg for s, n in ranges for pg in range(s // PAGE, -(-(s + n) // PAGE))}


def test_pagein_keeps_to_what_the_budget_keeps_resident(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    ts = _tensors(path)
    nonexpert_pages = _covered([(s, n) for s, n, e, rows in ts if not e and not rows])
    all_pages = _covered([(s, n) for s, n, _, _ in ts])
    total = sum(n for _, n, _, _ in ts)
    assert any(rows for *_, rows in ts)  # an untied model: streaming leaves its embedding rows to faults

    def ranges_for(options):
        with open_model(path, options) as s:
            return pagein_ranges(s.gf, s.moe, resolve_budget(options.ram_budget)), s.pagein

    # streaming (an expert cache of four slots): the non-expert weights only, every one of them but the
    # embedding table (a prompt needs a row per token)
    from streamer.experts.store import ExpertLayout

    gf = GGUFFile(path)
    from streamer.config import ModelConfig

    slot = ExpertLayout(gf, ModelConfig.from_gguf(gf)).slot_bytes
    got, p = ranges_for(StreamOptions(learn=False, expert_cache_bytes=4 * slot))
    assert _covered(got) == nonexpert_pages
    assert not (_covered(p.pieces) - nonexpert_pages), "a page holding only expert or embedding bytes was paged in"
    # a budget that holds every expert: the plan uses them in place, and the whole file is paged in
    got, p = ranges_for(StreamOptions(learn=False, ram_budget=4 * 2**30))
    assert _covered(got) == all_pages and sum(n for _, n in got) == total
    # --no-stream under a budget smaller than the weights: nothing up front (no page beyond the budget)
    got, p = ranges_for(StreamOptions(learn=False, stream=False, ram_budget=total // 2))
    assert got == [] and p is None
    with open_model(path, StreamOptions(learn=False, stream=False, ram_budget=total // 2)) as s:
        assert s.populate().total == 0  # bench's warm-up then reads nothing either
    got, _ = ranges_for(StreamOptions(learn=False, stream=False, ram_budget=4 * total))
    assert _covered(got) == all_pages


def test_forward_order_and_warmup_progress(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    names = {int(t.data_offset): t.name for t in GGUFReader(str(path)).tensors}
    with open_model(path, StreamOptions(learn=False, stream=False)) as s:
        order = [names[o] for o, _ in pagein_ranges(s.gf, s.moe, resolve_budget(None))]
        seen = []
        p = s.populate(lambda done, total: seen.append((done, total)))
    kinds = ["embd" if n == "token_embd.weight" else "exp" if "_exps." in n else "w" for n in order]
    assert kinds == sorted(kinds, key=["w", "exp", "embd"].index)  # non-expert, experts, embedding table
    layers = [int(n.split(".")[1]) for n in order if "_exps." in n]
    assert layers == sorted(layers)  # experts layer by layer, as the forward pass needs them
    assert seen and seen[-1] == (p.total, p.total) and p.done == p.total
    # and any 2 MiB block the page cache held in small folios (the file was just written), read again
    assert p.total == len(_covered(pagein_ranges(s.gf, s.moe, resolve_budget(None)))) * PAGE + p.reread_bytes


def test_warmup_progress_lines(capsys):
    from streamer.cli.common import progress_printer

    show = progress_printer("reading weights into RAM")
    for done in range(0, 101, 5):
        show(done * MiB, 100 * MiB)
    lines = capsys.readouterr().err.splitlines()  # not a terminal: a line every 10%
    assert [line.rsplit("(", 1)[1] for line in lines] == [f"{p}%)" for p in range(0, 101, 10)]
    assert all(line.startswith("reading weights into RAM: ") for line in lines)
    quiet = progress_printer("reading weights into RAM", after_s=3600)  # work faster than after_s: silent
    quiet(MiB, 2 * MiB)
    quiet(2 * MiB, 2 * MiB)
    assert capsys.readouterr().err == ""


def test_extend_reads_the_new_ranges_after_the_first_ones_even_once_ended():
    calls = []

    def advise(mm, start, n, advice):
        if advice == MADV_POPULATE_READ:
            calls.append((start, n))
        return 0

    mm = np.zeros(64 * PAGE, np.uint8)
    p = PageIn(mm, [(0, 3 * PAGE + 10)], chunk=2 * PAGE, advise=advise).start()
    p.wait()
    assert p.finished and calls == [(0, 2 * PAGE), (2 * PAGE, 2 * PAGE)]
    # a range sharing the last page's edge (two tensors side by side) and a far one: the shared page is not
    # read again; the page-in goes on in a new thread
    p.extend([(3 * PAGE + 10, PAGE), (40 * PAGE, PAGE)])
    p.wait()
    assert calls[2:] == [(4 * PAGE, PAGE), (40 * PAGE, PAGE)]
    assert p.done == p.total == 6 * PAGE and p.finished
    p.extend([])  # nothing new: nothing read, still finished
    assert p.finished and len(calls) == 4


def test_early_pagein_reads_only_the_nonexpert_weights_before_the_plan_and_never_on_a_refused_budget(synth_model):
    from streamer.config import ModelConfig
    from streamer.errors import StreamerError
    from streamer.experts.store import ExpertLayout
    from streamer.session import early_plan

    path = synth_model("tiny-moe", "Q8_0")
    ts = _tensors(path)
    nonexpert_pages = _covered([(s, n) for s, n, e, rows in ts if not e and not rows])
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    got = early_plan(gf, cfg, StreamOptions(learn=False), 4 * 2**30, None)[0]
    assert _covered(got) == nonexpert_pages  # neither an expert nor the embedding table's rows
    # a budget the plan refuses: nothing is read up front, and opening fails with the plan's error
    slot = ExpertLayout(gf, cfg).slot_bytes
    tiny = StreamOptions(learn=False, ram_budget=64 * 2**20)
    assert early_plan(gf, cfg, tiny, tiny.ram_budget, None)[0] == []
    with pytest.raises(StreamerError, match="too small"):
        open_model(path, tiny)
    # --no-stream under a budget smaller than the weights: nothing (the OS pages them), as pagein_ranges
    total = sum(n for _, n, _, _ in ts)
    assert early_plan(gf, cfg, StreamOptions(learn=False, stream=False), total // 2, None)[0] == []
    # the session's page-in is the early one, gone on with the rest: streaming, nothing more
    with open_model(path, StreamOptions(learn=False, expert_cache_bytes=4 * slot)) as s:
        p = s.populate()
        assert _covered(p.pieces) == nonexpert_pages and p.done == p.total
        assert not p.huge  # a part of the file: no 2 MiB pages, whose faults would read past the ranges
    # everything fits: the early page-in goes on with the experts and the embedding table, each page once,
    # the whole file in 2 MiB pages
    with open_model(path, StreamOptions(learn=False, ram_budget=4 * 2**30)) as s:
        p = s.populate()
        want = pagein_ranges(s.gf, s.moe, 4 * 2**30)
        # each page once, and any 2 MiB block the page cache held in small folios once more (the file is new)
        assert p.total - p.reread_bytes == len(_covered(want)) * PAGE and p.done == p.total
        extra = _covered(p.pieces) - _covered(want)  # the header's pages, in a block read again
        assert _covered(want) <= _covered(p.pieces) and len(extra) * PAGE <= p.reread_bytes
        assert p.huge and _covered(want) == _covered([(s, n) for s, n, _, _ in ts])  # every tensor
