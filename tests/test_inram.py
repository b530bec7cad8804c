"""--no-mmap (streamer/inram.py): the model read into the process's own memory gives the mapping's logits, bit for
bit, for single and split files, dense and MoE; it is anonymous memory, not the file's pages; a budget it does
not fit is one line and exit 2 before any read."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from forcing import run
from typer.testing import CliRunner

from cli import early
from streamer import inram
from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.options import StreamOptions
from streamer.session import open_model
from streamer.synth.writer import Split, spec_for, write_model

EXE = Path(sys.executable).parent / "stream-run"


def mapping_of(arr: np.ndarray) -> str:
    """The /proc/self/maps line of the mapping holding arr's first byte."""
    at = arr.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= at < hi:
            return line
    raise AssertionError("not mapped")


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """One tiny MoE as one file and split by size (about one expert tensor a shard)."""
    root = tmp_path_factory.mktemp("inram")
    spec = spec_for("tiny-moe", "Q4_K", real_vocab=False, seed=3)
    single = write_model(root / "one.gguf", spec)
    (root / "a").mkdir()
    split = write_model(root / "a" / "m.gguf", spec, split=Split(max_size=3 << 19))
    return Path(single), Path(split)


@pytest.mark.parametrize("io", ["auto", "buffered"])
def test_moe_logits_are_the_mapping_s_bits(moe_files, io):
    single, split = moe_files
    want = run(open_model(single, StreamOptions(stream=False, learn=False)))
    for path in (single, split):
        s = open_model(path, StreamOptions(mmap=False, learn=False, io=io))
        assert s.gf.in_memory and not s.streaming and s.model.watch is None
        line = mapping_of(s.gf.mm)
        assert len(line.split()) == 5, line  # no file name: anonymous memory, not the model file's pages
        assert s.pagein is None  # nothing paged in from the file
        assert np.array_equal(run(s), want), (path, io)
        s.close()


def test_dense_logits_are_the_mapping_s_bits(synth_model):
    path = synth_model("tiny", "Q4_K")
    want = run(open_model(path, StreamOptions(learn=False)))
    assert np.array_equal(run(open_model(path, StreamOptions(mmap=False, learn=False))), want)


def test_load_progress_counts_the_file(moe_files):
    _, split = moe_files
    seen = []
    s = open_model(split, StreamOptions(mmap=False, learn=False), load_progress=lambda d, t: seen.append((d, t)))
    size = sum(sh.size for sh in s.gf.shards)
    assert len(s.gf.shards) > 1 and seen[-1] == (size, size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_the_copy_outlives_the_file(moe_files, tmp_path):
    """The copy is the process's own: the file truncated after the load changes nothing (with the mapping,
    that is SIGBUS on the lost pages)."""
    single, _ = moe_files
    want = run(open_model(single, StreamOptions(stream=False, learn=False)))
    path = tmp_path / "m.gguf"
    shutil.copyfile(single, path)
    s = open_model(path, StreamOptions(mmap=False, learn=False))
    os.truncate(path, 4096)
    assert np.array_equal(run(s), want)


def test_read_into_memory_reads_every_byte(tmp_path, monkeypatch):
    """Many reads (a small CHUNK), a tail past the last 4 KiB boundary, two files at their bases, both I/O
    modes; progress ends at the total."""
    monkeypatch.setattr(inram, "CHUNK", 3 * 4096)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5 * 4096 + 123, 4096 * 2 + 7)]
    paths = []
    for i, d in enumerate(data):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(d.tobytes())
    bases = [0, 8 * 4096]
    shards = [(str(p), b, d.size) for p, b, d in zip(paths, bases, data)]
    try:  # where the filesystem takes O_DIRECT, direct=None reads the aligned part with it: more, smaller reads
        fd = os.open(paths[0], os.O_RDONLY | os.O_DIRECT)
        os.preadv(fd, [memoryview(inram.arena_empty(4096))], 0)
        os.close(fd)
        reads = {None: 5, False: 3}  # file 0: 3 x 4096 + 2 x 4096 + tail; file 1: 2 x 4096 + tail / one read each
    except OSError:
        reads = {None: 3, False: 3}
    seen = []
    for direct in (None, False):
        seen.clear()
        out = inram.read_into_memory(shards, bases[1] + data[1].size, direct, lambda d, t: seen.append((d, t)))
        for b, d in zip(bases, data):
            assert np.array_equal(out[b : b + d.size], d)
        total = sum(d.size for d in data)
        assert seen[-1] == (total, total) and len(seen) == reads[direct], (direct, seen)


def test_a_budget_it_does_not_fit_fails_before_reading(moe_files, monkeypatch):
    single, _ = moe_files

    def never(*a, **k):
        raise AssertionError("read before the budget check")

    monkeypatch.setattr(GGUFFile, "read_into_memory", never)
    with pytest.raises(StreamerError, match="--no-mmap reads the whole model into memory: .* more than --ram-budget"):
        open_model(single, StreamOptions(mmap=False, learn=False, ram_budget=os.path.getsize(single) // 2))


def test_cli_no_mmap_runs_and_refuses_a_small_budget(moe_files):
    single, _ = moe_files
    base = [str(EXE), "run", str(single), "--tokens", "1,2,3", "-n", "4", "--no-learn"]
    mapped = subprocess.run(base + ["--no-stream"], capture_output=True, text=True)
    copied = subprocess.run(base + ["--no-mmap"], capture_output=True, text=True)
    assert mapped.returncode == 0 and copied.returncode == 0, copied.stderr
    assert copied.stdout == mapped.stdout
    bad = subprocess.run(base + ["--no-mmap", "--ram-budget", "1M"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "--no-mmap reads the whole model" in bad.stderr, bad.stderr


@pytest.mark.parametrize("flag,want", [([], True), (["--mmap"], True), (["--no-mmap"], False)])
def test_cli_mmap_flags_reach_the_options(moe_files, monkeypatch, flag, want):
    """`run`'s --mmap / --no-mmap / neither arrive as StreamOptions.mmap True / False / True (in place by
    default), --no-mmap with nothing left to stream."""
    from streamer.cli import common
    from streamer.cli.main import app

    single, _ = moe_files
    seen = []

    def stop(gf, options, **kw):
        seen.append(options)
        raise StreamerError("stopped before loading")

    monkeypatch.setattr(common, "open_model", stop)
    r = CliRunner().invoke(app, ["run", str(single), "--tokens", "1,2,3", "-n", "1", "--no-learn", *flag])
    assert r.exit_code == 2 and "stopped before loading" in r.stderr, r.stderr
    assert seen[0].mmap is want and seen[0].stream is want  # --no-mmap: nothing left to stream


def test_no_early_pagein_with_no_mmap():
    assert early.flags(["sr", "run", "m.gguf", "--no-mmap"]) is None
