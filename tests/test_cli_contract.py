"""The command-line contract, through the real `stream-run` console script (not typer's test runner): every
user error prints exactly one line on stderr, starting 'error: ' and naming the problem, and exits with
code 2; no traceback, no usage box."""

import ctypes
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_gguf_file import broken_copy, tensor_info_at

STREAM_RUN = Path(sys.executable).parent / "stream-run"


def drop_file_permission_override():
    """In the child, before exec: as root, give up CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (bounding set,
    so the exec'd process never has them), so a mode-000 file is unreadable to it as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def stream_run(*args, preexec=None):
    return subprocess.run(
        [str(STREAM_RUN), *map(str, args)], capture_output=True, text=True, timeout=300, preexec_fn=preexec
    )


def one_error_line(r, pattern):
    import re

    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr  # progress lines (budget plan) may precede
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in r.stderr and "╭" not in r.stderr and "Usage:" not in r.stderr


@pytest.fixture(scope="module")
def files(synth_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    good = synth_model("tiny", "Q8_0")
    (d / "notes.txt").write_text("these are my notes, not a model\n")
    (d / "folder.gguf").mkdir()

    def llama(data):
        key = b"general.architecture"
        i = data.find(key) + len(key) + 4 + 8
        data[i : i + 5] = b"llama"

    def tq2_0(data):
        i = tensor_info_at(data, "blk.0.attn_q.weight")
        struct.pack_into("<I", data, i + 4 + 8 * 2, 35)  # TQ2_0: not supported

    broken_copy(good, d / "llama.gguf", patch=llama)
    broken_copy(good, d / "tq2_0.gguf", patch=tq2_0)
    broken_copy(good, d / "cut.gguf", truncate=good.stat().st_size - 1000)
    locked = broken_copy(good, d / "locked.gguf")
    os.chmod(locked, 0)
    return dict(dir=d, good=good, moe=synth_model("tiny-moe", "Q8_0"))


CASES = {
    "missing file": (["run", "{dir}/nope.gguf", "-p", "x"], r"cannot open .*nope\.gguf: No such file"),
    "directory": (["run", "{dir}/folder.gguf", "-p", "x"], r"folder\.gguf.*(directory|not a GGUF)"),
    "unreadable": (["run", "{dir}/locked.gguf", "-p", "x"], r"locked\.gguf.*(Permission denied|is not readable)"),
    "not a gguf": (["inspect", "{dir}/notes.txt"], r"notes\.txt is not a GGUF file"),
    "truncated": (["run", "{dir}/cut.gguf", "-p", "x"], r"cut\.gguf is truncated"),
    "arch": (["run", "{dir}/llama.gguf", "-p", "x"], r"unsupported architecture 'llama'"),
    "quant type": (["run", "{dir}/tq2_0.gguf", "-p", "x"], r"tensor 'blk\.0\.attn_q\.weight' has type TQ2_0"),
    "token id": (["run", "{good}", "--tokens", "1,2,999999"], r"token id 999999 is out of range"),
    "negative token id": (["run", "{good}", "--tokens", "5,-1"], r"token id -1 is out of range"),
    "context": (["run", "{good}", "-p", "a prompt far longer than the context", "-c", "4"], r"context overflow"),
    "budget": (["run", "{moe}", "-p", "x", "--ram-budget", "64M"], r"too small for this model: it needs at least"),
    "budget unit": (["run", "{moe}", "-p", "x", "--ram-budget", "12X"], r"cannot read size '12X'"),
    "flag type": (
        ["run", "{good}", "-p", "x", "-n", "lots"],
        r"Invalid value for '-n' / '--n-predict'.*"
        r"\(see 'stream-run run --help'\)",
    ),
    "unknown flag": (["run", "{good}", "-p", "x", "--turbo"], r"No such option: --turbo"),
    "unknown command": (["frobnicate"], r"No such command 'frobnicate'"),
    "missing model": (["run"], r"Missing argument"),
    "output exists": (["synth", "{good}", "--preset", "tiny"], r"exists"),
}


@pytest.mark.parametrize("case", CASES)
def test_user_error_is_one_line_and_exit_code_2(files, case):
    args, pattern = CASES[case]
    args = [a.format(**files) for a in args]
    preexec = None
    if case == "unreadable" and os.geteuid() == 0:
        preexec = drop_file_permission_override
        # the premise: this file is unreadable to such a process
        probe = subprocess.run(
            [sys.executable, "-c", f"open({args[1]!r}, 'rb')"], preexec_fn=preexec, capture_output=True, text=True
        )
        assert "PermissionError" in probe.stderr, probe.stderr
    before = files["good"].read_bytes() if case == "output exists" else None
    one_error_line(stream_run(*args, preexec=preexec), pattern)
    if before is not None:
        assert files["good"].read_bytes() == before  # never written in place


def test_a_reader_that_goes_away_is_not_an_error(files):
    """`stream-run run ... | head -c 5`: the pipe closes; the run stops quietly (exit 141, as a tool killed by
    SIGPIPE), with no error line and no 'Exception ignored' noise from the interpreter's exit."""
    p = subprocess.Popen(
        [str(STREAM_RUN), "run", str(files["good"]), "-p", "hello", "-n", "-1", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stdout.read(5)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141, err
    assert "error" not in err.lower() and "Traceback" not in err and "Exception ignored" not in err, err
