"""Split GGUFs (gguf-split's shard sets): written by `synth --split-max-size`, read back by gguf-py's GGUFReader
(an independent parser) shard by shard, run with logits identical to the single file (resident and streamed,
with one layer's gate/up/down in different shards), and every kind of broken shard set refused with one line."""

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from forcing import run
from gguf import GGUFReader

from streamer.experts.store import ExpertLayout
from streamer.gguf_file import GGUFFile
from streamer.mapping import ALIGN, PAGE
from streamer.options import StreamOptions
from streamer.session import open_model
from streamer.synth.writer import Split, spec_for, write_model

EXE = Path(sys.executable).parent / "stream-run"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same tiny MoE (same seed) as one file, split by size (1.5 MiB: about one expert tensor per shard) and
    split 5 tensors a shard with no tensors in the first shard (gguf-split --no-tensor-first-split)."""
    root = tmp_path_factory.mktemp("split")
    spec = spec_for("tiny-moe", "Q8_0", real_vocab=False, seed=7)
    single = write_model(root / "one.gguf", spec)
    (root / "a").mkdir()
    (root / "b").mkdir()
    by_size = write_model(root / "a" / "m.gguf", spec, split=Split(max_size=3 << 19))
    small_first = write_model(root / "b" / "m.gguf", spec, split=Split(max_tensors=5, small_first=True))
    return Path(single), Path(by_size), Path(small_first)


def shard_files(first: Path) -> list[Path]:
    return sorted(first.parent.glob(first.name.split("-00001-of-")[0] + "-*-of-*.gguf"))


def test_shards_are_what_gguf_split_writes(models):
    single, by_size, small_first = models
    ref = {t.name: t for t in GGUFReader(str(single)).tensors}
    for first in (by_size, small_first):
        files = shard_files(first)
        n = len(files)
        assert n > 3 and first.name == f"m-00001-of-{n:05d}.gguf"
        assert [f.name for f in files] == [f"m-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]
        seen = {}
        for i, f in enumerate(files):
            r = GGUFReader(str(f))  # gguf-py's own parser, one shard at a time
            field = lambda k, r=r: r.fields[k].parts[r.fields[k].data[0]][0].item()  # noqa: E731
            assert (field("split.no"), field("split.count"), field("split.tensors.count")) == (i, n, len(ref))
            assert ("general.architecture" in r.fields) == (i == 0)  # only the first carries the metadata
            assert ("tokenizer.ggml.tokens" in r.fields) == (i == 0)
            for t in r.tensors:
                assert t.name not in seen
                seen[t.name] = i
                assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(ref[t.name].data).view(np.uint8))
        assert set(seen) == set(ref)
        gf = GGUFFile(first)  # ours agrees with gguf-py on where every tensor is
        assert [s.n_tensors for s in gf.shards] == [len(GGUFReader(str(f)).tensors) for f in files]
        # every shard starts at a 2 MiB-aligned address (its 2 MiB page cache folios map whole), the
        # mapping ends at the last shard's last page, and each shard's bytes are the file's
        assert all((gf.mm.ctypes.data + s.base) % ALIGN == 0 for s in gf.shards)
        assert gf.mm.size == gf.shards[-1].base + -(-gf.shards[-1].size // PAGE) * PAGE
        for s, f in zip(gf.shards, files):
            assert gf.mm[s.base : s.base + s.size].tobytes() == f.read_bytes()
        for name, t in gf.tensors.items():
            assert t.shard == seen[name]
            assert np.shares_memory(gf.view(name), gf.mm) and not gf.view(name).flags.writeable
    assert len(GGUFReader(str(shard_files(small_first)[0])).tensors) == 0


def test_one_layer_spans_shards_and_logits_are_identical(models):
    single, by_size, small_first = models
    gf = GGUFFile(by_size)
    shards = {p: gf.tensors[f"blk.1.ffn_{p}_exps.weight"].shard for p in ("gate", "up", "down")}
    assert len(set(shards.values())) == 3, shards  # gate, up and down of one layer in three files
    want = run(open_model(single, StreamOptions(stream=False, learn=False)))
    for first in (by_size, small_first):
        assert np.array_equal(
            run(open_model(first, StreamOptions(stream=False, learn=False))), want
        )  # resident, in place
        s = open_model(first, StreamOptions(stream=False, learn=False))
        sb = ExpertLayout(s.gf, s.cfg).slot_bytes
        for slots, prefetch, io in ((4, False, "auto"), (9, True, "buffered"), (64, True, "auto")):
            s = open_model(first, StreamOptions(learn=False, prefetch=prefetch, expert_cache_bytes=slots * sb, io=io))
            assert s.streaming
            assert np.array_equal(run(s), want), (first, slots, prefetch, io)
            assert s.model.ffn.traffic.report()["totals"]["miss"] > 0
            s.close()


def test_populate_advise_and_watch_cover_every_shard(models, monkeypatch):
    _, by_size, _ = models
    s = open_model(by_size, StreamOptions(stream=False, learn=False))
    assert s.model.watch.paths == [str(f) for f in shard_files(by_size)]
    s.populate()  # touches pages of every shard (it would fault on a bad mapping)
    last = shard_files(by_size)[-1]
    os.utime(last, ns=(0, 0))  # a later shard rewritten under us is noticed, and named
    with pytest.raises(Exception, match=re.escape(str(last)) + " was rewritten while in use"):
        s.model.watch.check()


def test_usage_key_counts_every_shard(models, tmp_path):
    from streamer.gguf_file import model_key

    _, by_size, _ = models
    k1 = model_key(GGUFFile(by_size))
    files = shard_files(by_size)
    copies = []
    for f in files:
        copies.append(tmp_path / f.name)
        copies[-1].write_bytes(f.read_bytes())
    data = bytearray(copies[-1].read_bytes())
    data[-1] ^= 1  # a different last shard (its data): same header, so same key; a different header changes it
    copies[-1].write_bytes(data)
    assert model_key(GGUFFile(copies[0])) == k1
    with open(copies[-1], "ab") as f:
        f.write(b"\0" * 32)
    assert model_key(GGUFFile(copies[0])) != k1


# ---- broken shard sets, through the real command line ----
def _copy_set(first: Path, dst: Path) -> list[Path]:
    dst.mkdir()
    out = []
    for f in shard_files(first):
        out.append(dst / f.name)
        out[-1].write_bytes(f.read_bytes())
    return out


def _patch_value(path: Path, key: str, fmt: str, value) -> None:
    """Overwrite the scalar value of metadata key `key` in place (its type stays)."""
    data = bytearray(path.read_bytes())
    k = struct.pack("<Q", len(key)) + key.encode()
    i = data.find(k)
    assert i > 0
    at = i + len(k) + 4
    data[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(data)


def _rename_tensor(path: Path, old: str, new: str) -> None:
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    k = struct.pack("<Q", len(old)) + old.encode()
    i = data.find(k)
    assert i > 0
    data[i : i + len(k)] = struct.pack("<Q", len(new)) + new.encode()
    path.write_bytes(data)


def _cli_error(*args) -> str:
    r = subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


def test_broken_shard_sets_fail_with_one_line(models, tmp_path):
    _, by_size, _ = models
    n = len(shard_files(by_size))

    files = _copy_set(by_size, tmp_path / "later")
    msg = _cli_error("inspect", files[1])
    assert msg == f"error: {files[1]} is shard 2 of {n} of a split model: open the first shard, {files[0]}"

    files = _copy_set(by_size, tmp_path / "missing")
    files[2].unlink()
    msg = _cli_error("run", files[0], "-p", "x", "-n", "1")
    assert msg == f"error: {files[2]} is missing: shard 3 of {n} of {files[0]}"

    files = _copy_set(by_size, tmp_path / "no")
    _patch_value(files[3], "split.no", "<H", 1)
    msg = _cli_error("inspect", files[0])
    assert msg.startswith(
        f"error: {files[3]}: its split.no/split.count say shard 2 of {n}, but by name it is shard 4 of {n}"
    )

    files = _copy_set(by_size, tmp_path / "count")
    _patch_value(files[1], "split.count", "<H", n + 1)
    msg = _cli_error("inspect", files[0])
    assert msg.startswith(f"error: {files[1]}: its split.no/split.count say shard 2 of {n + 1}")

    files = _copy_set(by_size, tmp_path / "dup")
    gf = GGUFFile(files[0])
    a, b = (gf.tensors[f"blk.{i}.ffn_up_exps.weight"].shard for i in (0, 1))
    assert a < b
    del gf
    _rename_tensor(files[b], "blk.1.ffn_up_exps.weight", "blk.0.ffn_up_exps.weight")
    msg = _cli_error("inspect", files[0])
    assert msg == f"error: {files[b]}: tensor 'blk.0.ffn_up_exps.weight' is also in {files[a]} (a tensor in two shards)"

    files = _copy_set(by_size, tmp_path / "total")
    n_tensors = GGUFFile(files[0]).fields["split.tensors.count"]
    _patch_value(files[0], "split.tensors.count", "<i", n_tensors + 1)
    msg = _cli_error("inspect", files[0])
    assert msg == (
        f"error: {files[0]}: split.tensors.count is {n_tensors + 1}, but its {n} shards hold {n_tensors} tensors"
    )

    files = _copy_set(by_size, tmp_path / "renamed")
    odd = files[0].with_name("model.gguf")
    files[0].rename(odd)
    msg = _cli_error("inspect", odd)
    assert msg.startswith(f"error: {odd} is the first of {n} shards, but its name does not end in -00001-of-")


def test_inspect_lists_the_shards(models):
    import json

    _, by_size, _ = models
    files = shard_files(by_size)
    r = subprocess.run([str(EXE), "inspect", str(by_size), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert [s["file"] for s in info["shards"]] == [str(f) for f in files]
    assert [s["bytes"] for s in info["shards"]] == [f.stat().st_size for f in files]
    assert info["file_bytes"] == sum(f.stat().st_size for f in files)
    assert sum(s["tensors"] for s in info["shards"]) == len(GGUFFile(by_size).tensors)
    r = subprocess.run([str(EXE), "inspect", str(by_size)], capture_output=True, text=True, timeout=120)
    assert f"shard     2/{len(files)} {files[1]} (" in r.stdout


def test_synth_split_flags(tmp_path):
    out = tmp_path / "s.gguf"
    r = subprocess.run(
        [str(EXE), "synth", str(out), "--preset", "tiny", "--vocab", "bytes", "--split-max-tensors", "7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    files = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(files) > 2 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    assert all(len(GGUFReader(str(f)).tensors) <= 7 for f in files)
    # the set exists: refused without --force, and nothing is touched
    before = {f: f.stat().st_mtime_ns for f in files}
    msg = _cli_error("synth", out, "--preset", "tiny", "--vocab", "bytes", "--split-max-tensors", "7")
    assert msg == f"error: {files[0]} exists (use --force to replace it)"
    assert {f: f.stat().st_mtime_ns for f in files} == before
    assert _cli_error("synth", tmp_path / "t.gguf", "--split-max-size", "0").startswith(
        "error: --split-max-size must be positive"
    )


def test_a_failed_split_write_leaves_nothing(tmp_path, monkeypatch):
    import streamer.synth.writer as writer

    calls = {"n": 0}
    real = writer.random_weight

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(writer, "random_weight", failing)
    with pytest.raises(OSError):
        write_model(tmp_path / "m.gguf", spec_for("tiny-moe", "Q8_0", real_vocab=False), split=Split(max_size=1 << 20))
    assert list(tmp_path.iterdir()) == []


def test_a_later_shard_truncated_mid_step_is_one_line(models, tmp_path):
    """A later shard cut under a running process: touching its vanished pages in the shared mapping raises
    SIGBUS, which the handler run installs for a split model turns into one line naming the set."""
    _, by_size, _ = models
    files = _copy_set(by_size, tmp_path / "cut")
    code = f"""
import os
from streamer.filewatch import install_bus_error_exit
from streamer.gguf_file import GGUFFile
from streamer.mapping import ALIGN, PAGE
gf = GGUFFile({str(files[0])!r})
install_bus_error_exit({str(files[0])!r} + " (or one of its {len(files)} shards)")
last = gf.shards[-1]
print(int(gf.mm[last.base:last.base + 4096].sum() > 0), flush=True)
os.truncate({str(files[-1])!r}, 0)
print(int(gf.mm[last.base:last.base + last.size].sum()), flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout.splitlines() == ["1"]
    assert r.stderr.splitlines() == [
        f"error: {files[0]} (or one of its {len(files)} shards) was truncated or changed "
        f"while in use (bus error reading its mapping)"
    ]


def test_drop_cached_evicts_those_bytes_of_each_shard(models):
    """GGUFFile.drop_cached takes offsets in the mapping of all shards: it evicts the part of each file they cover
    (asked of the kernel: mincore through bench/cgroup.py), and nothing else."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import cgroup  # bench/cgroup.py: cached_bytes, evict

    _, by_size, _ = models
    files = shard_files(by_size)
    for f in files:
        cgroup.evict(f)
        if cgroup.cached_bytes(f):
            pytest.skip("this filesystem keeps files in the page cache (tmpfs)")
        f.read_bytes()
    full = [cgroup.cached_bytes(f) for f in files]
    gf = GGUFFile(by_size)  # maps every file and reads their headers
    one, two = gf.shards[1], gf.shards[2]
    cut1, cut2 = one.size // 2 // PAGE * PAGE, two.size // 2 // PAGE * PAGE
    gf.drop_cached(one.base + cut1, two.base + cut2 - (one.base + cut1))  # the gap between the files too
    after = [cgroup.cached_bytes(f) for f in files]
    head = 64 * 1024  # the header's page and what the kernel's fault-around mapped with it stay (they are mapped)
    assert after[1] == cut1 and full[2] - cut2 <= after[2] <= full[2] - cut2 + head + PAGE  # its last page whole
    assert after[:1] + after[3:] == full[:1] + full[3:]
    gf.close()
