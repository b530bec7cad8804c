"""Faults while running: the model file truncated, rewritten or replaced under a live session, expert reads
that come back short or fail with EIO, a bus error in the middle of a step, and a crash while the
learned-pinning sidecar is written. Each stops with one clear error (or, for a replaced file, carries on
with the file it opened), never uses a partial expert, and never loses a file."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from invariants import assert_cache_consistent

from streamer.errors import ModelFileChanged, StreamerError
from streamer.experts.store import ExpertLayout
from streamer.options import StreamOptions
from streamer.session import open_model

TOKENS = np.array([3, 77, 120, 9, 201], dtype=np.int64)
STREAM_RUN = Path(sys.executable).parent / "stream-run"


def copy_of(path, tmp_path) -> Path:
    dst = tmp_path / "model.gguf"
    shutil.copyfile(path, dst)
    return dst


def streaming(path, slots=8):
    layout_session = open_model(path, StreamOptions(stream=False, learn=False))
    slot = ExpertLayout(layout_session.gf, layout_session.cfg).slot_bytes
    return open_model(path, StreamOptions(learn=False, expert_cache_bytes=slots * slot))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_truncated_between_steps_is_a_clear_error(synth_model, tmp_path, preset):
    path = copy_of(synth_model(preset, "Q8_0"), tmp_path)
    s = open_model(path, StreamOptions(learn=False))
    cache = s.model.new_state()
    s.model.forward(TOKENS, cache)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ModelFileChanged, match=r"model.gguf changed size while in use \(\d+ -> \d+ bytes\)"):
        s.model.forward(TOKENS[:1], cache)
    assert cache.n == len(TOKENS)  # the refused step wrote nothing
    s.close()


def test_rewritten_in_place_with_the_same_size_is_a_clear_error(synth_model, tmp_path):
    path = copy_of(synth_model("tiny", "Q8_0"), tmp_path)
    s = open_model(path, StreamOptions(learn=False))
    s.model.forward(TOKENS, s.model.new_state())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # as `cp other.gguf model.gguf` would
    with pytest.raises(ModelFileChanged, match="rewritten while in use"):
        s.model.forward(TOKENS, s.model.new_state())


def test_replaced_by_rename_carries_on_with_the_file_it_opened(synth_model, tmp_path):
    """`mv new.gguf model.gguf` swaps the directory entry; the open mapping keeps the old file's bytes."""
    path = copy_of(synth_model("tiny-moe", "Q8_0"), tmp_path)
    s = streaming(path)
    want = s.model.forward(TOKENS, s.model.new_state())
    other = tmp_path / "other.gguf"
    shutil.copyfile(synth_model("tiny-moe", "Q8_0", seed=9), other)
    os.replace(other, path)
    assert np.array_equal(s.model.forward(TOKENS, s.model.new_state()), want)


def faulty_preadv(real, mode, fail_after=0):
    """os.preadv that, after `fail_after` good calls, fills only half the buffer and says so ("short"),
    scribbles half and raises EIO ("eio")."""
    calls = [0]

    def preadv(fd, buffers, offset):
        calls[0] += 1
        if calls[0] <= fail_after:
            return real(fd, buffers, offset)
        mv = buffers[0]
        if mode == "short":
            half = real(fd, [mv[: len(mv) // 2]], offset)
            return half
        mv[: len(mv) // 2] = b"\xff" * (len(mv) // 2)
        raise OSError(5, "Input/output error")

    return preadv


@pytest.mark.parametrize("mode,message", [("short", "short read of expert"), ("eio", "I/O error reading expert")])
def test_failed_expert_reads_stop_the_step_and_no_partial_expert_is_used(synth_model, monkeypatch, mode, message):
    import streamer.experts.store as store

    path = synth_model("tiny-moe", "Q8_0")
    want = open_model(path, StreamOptions(stream=False, learn=False)).model.forward(
        TOKENS, open_model(path, StreamOptions(stream=False, learn=False)).model.new_state()
    )
    s = streaming(path)
    cache = s.model.ffn.source.cache
    monkeypatch.setattr(store.os, "preadv", faulty_preadv(os.preadv, mode, fail_after=6))
    with pytest.raises(StreamerError, match=message):
        s.model.forward(TOKENS, s.model.new_state())
    s.model.ffn.source.drain()
    assert all(e.refs == 0 for e in cache.entries.values())
    assert_cache_consistent(cache)
    monkeypatch.undo()
    # whatever the failed reads left in their slots is never served: the same session, with the disk
    # healthy again, gives the resident logits bit for bit
    assert np.array_equal(s.model.forward(TOKENS, s.model.new_state()), want)


def test_bus_error_mid_step_is_one_line_and_exit_code_2(tmp_path):
    """A page of the mapping vanishing under a kernel (the file truncated mid-step) would kill the interpreter
    with 'Bus error'; the installed handler turns it into one error line and exit code 2."""
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\1" * (1 << 20))
    code = f"""
import os, numpy as np
from streamer.filewatch import install_bus_error_exit
install_bus_error_exit({str(f)!r})
mm = np.memmap({str(f)!r}, dtype=np.uint8, mode="r")
print(int(mm[:4096].sum()), flush=True)
os.truncate({str(f)!r}, 0)
print(int(mm.sum()), flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout.splitlines() == ["4096"]
    assert r.stderr.splitlines() == [
        f"error: {f} was truncated or changed while in use (bus error reading its mapping)"
    ]


def test_chat_stops_with_one_line_when_the_model_is_truncated_between_turns(synth_model, tmp_path):
    path = copy_of(synth_model("tiny-moe", "Q8_0"), tmp_path)
    p = subprocess.Popen(
        [str(STREAM_RUN), "chat", str(path), "-n", "3", "--temp", "0", "--ram-budget", "4G"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        p.stdin.write("hello\n")
        p.stdin.flush()
        # a hang guard, not a speed test: on a fresh install the first turn compiles the chat's kernels (CI once
        # took 124 s on a busy 2-core machine)
        deadline = time.monotonic() + 900
        while not p.stderr.readline().startswith("[prompt:"):  # the first turn's stats line: it has replied
            assert time.monotonic() < deadline and p.poll() is None
        os.truncate(path, path.stat().st_size - 4096)
        out, err = p.communicate("and again\n", timeout=300)
    finally:
        p.kill()
    assert p.returncode == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "changed size while in use" in lines[-1], err
    assert sum(line.startswith("error: ") for line in lines) == 1 and "Traceback" not in err


def test_sidecar_write_is_atomic(synth_model, monkeypatch):
    """A crash while saving the learned-pinning profile leaves the previous profile whole and no temp file."""
    import json

    from streamer.experts.usage import Usage
    from streamer.gguf_file import GGUFFile

    gf = GGUFFile(synth_model("tiny-moe", "Q8_0"))
    u = Usage(gf, 4, 16)
    u.record(1, [3, 3])
    u.save()
    before = u.path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies half-way through json.dumps

    again = Usage(gf, 4, 16)
    again.record(2, [5])
    monkeypatch.setattr(json, "dumps", crash)
    with pytest.raises(KeyboardInterrupt):
        again.save()
    monkeypatch.undo()
    assert u.path.read_bytes() == before
    assert sorted(p.name for p in u.path.parent.iterdir()) == [u.path.name]


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_run_stops_with_one_line_when_the_model_is_truncated_mid_run(synth_model, tmp_path, cut):
    """Whatever the run is doing when the file is cut (a step in progress: bus error on the mapping, or a short
    expert read; between steps: the size check), it stops with exit code 2 and one error line."""
    path = copy_of(synth_model("demo", "Q4_K"), tmp_path)
    p = subprocess.Popen(
        [str(STREAM_RUN), "run", str(path), "-p", "x", "-n", "-1", "--ignore-eos", "-c", "512", "--ram-budget", "300M"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        p.stdout.read(40)  # generating
        os.truncate(path, int(path.stat().st_size * cut))
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, err
    assert re.search(r"changed size while in use|truncated or changed while in use|short read of expert", lines[-1])
    assert "Traceback" not in err
