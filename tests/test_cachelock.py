"""numba's on-disk cache under processes compiling at once (streamer/kernels/_cachelock.py): a save or load by
another process waits while the cache directory's lock is held, seen in the kernel's own lock table
(/proc/locks), and then goes on to the right result."""

import fcntl
import os
import subprocess
import sys
import time

import pytest

from streamer.kernels._cachelock import LOCK_NAME

# A numba function cached beside its own file, in a process that imported the kernels (which installs the lock).
MODULE = """
from numba import njit

@njit(cache=True)
def plus_one(x):
    return x + 1
"""
SCRIPT = """
import sys
import streamer.kernels  # the kernels' import installs the cache lock
sys.path.insert(0, sys.argv[1])
print("start", flush=True)
from cached_mod import plus_one
print("done", plus_one(41), flush=True)
"""


def _run(tmp_path):
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)  # cache beside cached_mod.py
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _waiting_on(pid: int, inode: int) -> bool:
    """Whether pid is blocked on a lock of this inode ('->' marks a waiter in /proc/locks)."""
    with open("/proc/locks") as f:
        return any("->" in ln and f" {pid} " in ln and f":{inode} " in ln for ln in f)


@pytest.mark.parametrize("warm", [False, True], ids=["save", "load"])
def test_cache_access_waits_for_the_lock(tmp_path, warm):
    (tmp_path / "cached_mod.py").write_text(MODULE)
    cache = tmp_path / "__pycache__"
    if warm:  # compiled and saved once, so the next process only loads
        p = _run(tmp_path)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "done 42" in out, err
        assert list(cache.glob("*.nbc"))
    cache.mkdir(exist_ok=True)
    fd = os.open(cache / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a save in another process holds it
        p = _run(tmp_path)
        inode = os.fstat(fd).st_ino
        deadline = time.monotonic() + 120
        while not _waiting_on(p.pid, inode):
            assert p.poll() is None, ("finished without waiting for the lock", p.communicate())
            assert time.monotonic() < deadline, "never waited for the lock"
            time.sleep(0.05)
    finally:
        os.close(fd)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.split() == ["start", "done", "42"], err
