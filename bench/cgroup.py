#!/usr/bin/env python
"""Cold-cache and RAM-cap helpers for benchmarks (Linux, root, cgroup v1 memory controller). Stdlib only.

    python bench/cgroup.py evict FILE...               drop FILE from the page cache, print what stayed
    python bench/cgroup.py run --cap 8G [--evict F] -- CMD ARGS...
                                                       run CMD in a fresh memory cgroup, print one JSON line
    python bench/cgroup.py selftest                    over-cap child is OOM-killed, under-cap child completes

The cap is `memory.limit_in_bytes` of /sys/fs/cgroup/memory/NAME, which counts the page cache the child
brings in (mmap'd model pages included) as well as its anonymous memory. A page already in the page cache
was charged to whoever read it first, so evict the model file before a capped run or the cap does not
bite. The child joins the cgroup before it execs (sh writes its own pid to cgroup.procs, then `exec`s the
command), so every byte the command touches is charged. Afterwards we read memory.max_usage_in_bytes,
memory.failcnt and memory.oom_control's oom_kill counter, then force_empty and remove the cgroup.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

CGROUP_ROOT = "/sys/fs/cgroup/memory"
PAGE = os.sysconf("SC_PAGE_SIZE")


REPORTED = "/sys/module/page_reporting/parameters/reported_kib"  # the guest kernel's free page reporting


def settle(quiet: float, limit: float = 180.0, counter: str = REPORTED, poll: float = 0.5) -> tuple[float, float]:
    """Wait until the kernel's free page reporting (virtio-balloon: freed memory handed back to the host) has
    reported nothing for `quiet` seconds, at most `limit` seconds in all: (seconds waited, MiB reported meanwhile).
    On a VM whose kernel does this, the memory a run frees (llama.cpp's 17 GB of repacked weights) is reported for
    20-25 s after it exits, and the host's work on it shows in the next run as CPU steal and stalled steps
    (bench/RESULTS.md, 2026-12-04). Where the counter is missing (another kernel, not a VM) it returns
    (0, 0) at once."""

    def read() -> int:
        with open(counter) as f:
            return int(f.read())

    try:
        first = last = read()
    except (OSError, ValueError):
        return 0.0, 0.0
    t0 = still = time.monotonic()
    while time.monotonic() - still < quiet and time.monotonic() - t0 < limit:
        time.sleep(poll)
        now = read()
        if now != last:
            last, still = now, time.monotonic()
    return time.monotonic() - t0, (last - first) / 1024


def parse_size(text: str | int) -> int:
    """'8G', '512M', '1.5GiB', '100000' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


# ---- page cache ----
def evict(path: str | os.PathLike) -> None:
    """Drop the file's pages from the page cache. DONTNEED skips dirty pages (a file just written by the
    synth command is mostly dirty), so write them back first; pages some process still maps may stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def cached_bytes(path: str | os.PathLike) -> int:
    """How many bytes of the file are in the page cache now (mincore over a read-only mapping; mapping
    without touching reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            n = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            resident = n - bytes(vec).count(0)  # the kernel sets only bit 0 (resident) of each byte
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * PAGE, size)


def evict_all(paths) -> dict[str, int]:
    """Evict each file; return the bytes of each still cached afterwards (0 = fully cold)."""
    out = {}
    for p in paths:
        evict(p)
        out[str(p)] = cached_bytes(p)
    return out


# ---- memory cgroup ----
@dataclass
class CappedRun:
    cmd: list[str]
    limit_bytes: int
    returncode: int | None = None
    oom_killed: bool = False
    killed_by_signal: str | None = None
    max_usage_bytes: int = 0
    failcnt: int = 0  # memory + memsw failcnt as the kernel reports them (stayed 0 on OOM on 6.18: use oom_kill)
    oom_kill_count: int = 0
    under_oom: int = 0
    wall_s: float = 0.0
    # the command's own rusage (wait4 in a small wrapper; the cgroup's sh execs the command: same process)
    rusage_maxrss_bytes: int = 0  # peak RSS, mmap'd file pages included
    rusage_read_bytes: int = 0  # ru_inblock x 512 = the kernel's read_bytes: what came from storage
    rusage_user_s: float = 0.0
    rusage_sys_s: float = 0.0
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("stdout")
        d.pop("stderr")
        return d


class MemoryCgroup:
    """A fresh cgroup-v1 memory cgroup with a hard limit; use as a context manager (removed on exit)."""

    def __init__(self, limit_bytes: int, name: str | None = None, root: str = CGROUP_ROOT):
        if not os.path.isdir(root):
            raise RuntimeError(f"{root} is not mounted (cgroup v1 memory controller needed)")
        self.limit = int(limit_bytes)
        self.path = os.path.join(root, name or f"streamrun-bench-{os.getpid()}-{time.monotonic_ns()}")

    def _w(self, key: str, value) -> None:
        with open(os.path.join(self.path, key), "w") as f:
            f.write(str(value))

    def _r(self, key: str) -> str:
        with open(os.path.join(self.path, key)) as f:
            return f.read()

    def __enter__(self) -> MemoryCgroup:
        os.mkdir(self.path)
        try:
            self._w("memory.limit_in_bytes", self.limit)
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self._w("memory.memsw.limit_in_bytes", self.limit)  # no escaping the cap into swap
            self._w("memory.swappiness", 0)
        except OSError:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, prefixed so the process joins this cgroup before exec'ing the real command."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["/bin/sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]

    def stats(self) -> dict:
        oom = dict(line.split() for line in self._r("memory.oom_control").splitlines() if line.strip())
        memsw = os.path.join(self.path, "memory.memsw.failcnt")
        return dict(
            max_usage_bytes=int(self._r("memory.max_usage_in_bytes")),
            failcnt=int(self._r("memory.failcnt"))
            + (int(self._r("memory.memsw.failcnt")) if os.path.exists(memsw) else 0),
            oom_kill_count=int(oom.get("oom_kill", 0)),
            under_oom=int(oom.get("under_oom", 0)),
        )

    def remove(self) -> None:
        if not os.path.isdir(self.path):
            return
        for _ in range(50):  # tasks may take a moment to leave after exit
            try:
                if not self._r("cgroup.procs").strip():
                    break
            except OSError:
                break
            time.sleep(0.1)
        try:
            self._w("memory.force_empty", 0)  # reclaim the cgroup's page cache before removing it
        except OSError:
            pass
        try:
            os.rmdir(self.path)
        except OSError as e:
            print(f"warning: could not remove {self.path}: {e}", file=sys.stderr)


# Measuring wrapper. ru_maxrss of a forked child starts from its parent's RSS high-water mark (fork copies
# the mm; exec saves the old mm's hiwater into the child's maxrss), so a child of this (possibly large)
# Python process would report at least our RSS. A minimal `python3 -S` (~10 MB) forks the command, waits
# for it with wait4 (the command's own rusage) and writes it as JSON to argv[1].
_WAIT4 = r"""
import json, os, sys
out, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
with open(out, "w") as f:
    json.dump({"returncode": code, "maxrss_bytes": ru.ru_maxrss * 1024, "read_bytes": ru.ru_inblock * 512,
               "user_s": ru.ru_utime, "sys_s": ru.ru_stime}, f)
sys.exit(code if code >= 0 else 128 - code)
"""
WRAPPER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _run_measured(argv: list[str], res: CappedRun, capture: bool, timeout: float | None, env) -> None:
    """Run argv under the wait4 wrapper (own process group, killed whole on timeout); fill res."""
    import tempfile
    import threading

    fd, ru_path = tempfile.mkstemp(prefix="wait4-", suffix=".json")
    os.close(fd)
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE) if capture else {}
    t0 = time.perf_counter()
    try:
        p = subprocess.Popen(
            [WRAPPER_PYTHON, "-S", "-c", _WAIT4, ru_path, *argv], env=env, start_new_session=True, **kw
        )
        out: dict[str, bytes] = {}
        readers = []
        if capture:
            for name, pipe in (("stdout", p.stdout), ("stderr", p.stderr)):
                t = threading.Thread(target=lambda n=name, f=pipe: out.__setitem__(n, f.read()), daemon=True)
                t.start()
                readers.append(t)
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in readers:
            t.join()
        res.wall_s = time.perf_counter() - t0
        res.stdout = out.get("stdout", b"").decode("utf-8", "replace")
        res.stderr = out.get("stderr", b"").decode("utf-8", "replace")
        with open(ru_path) as f:
            text = f.read()
    finally:
        os.unlink(ru_path)
    if timed_out or not text:
        res.returncode = None
        res.killed_by_signal = "timeout" if timed_out else "wrapper failed"
        return
    ru = json.loads(text)
    res.returncode = ru["returncode"]
    if res.returncode < 0:
        res.killed_by_signal = signal.Signals(-res.returncode).name
    res.rusage_maxrss_bytes, res.rusage_read_bytes = ru["maxrss_bytes"], ru["read_bytes"]
    res.rusage_user_s, res.rusage_sys_s = ru["user_s"], ru["sys_s"]


def run_capped(
    cmd: list[str],
    limit_bytes: int | str | None,
    capture: bool = True,
    timeout: float | None = None,
    env: dict | None = None,
) -> CappedRun:
    """Run cmd (optionally inside a fresh memory cgroup with this limit); report usage, OOM kills and the
    child's own peak RSS and disk reads (wait4 rusage).

    limit_bytes=None runs without a cap (same result fields; the cgroup counters stay 0)."""
    limit = parse_size(limit_bytes) if limit_bytes is not None else 0
    res = CappedRun(cmd=list(cmd), limit_bytes=limit)
    if not limit:
        _run_measured(list(cmd), res, capture, timeout, env)
        return res
    with MemoryCgroup(limit) as cg:
        _run_measured(cg.wrap(list(cmd)), res, capture, timeout, env)
        for k, v in cg.stats().items():
            setattr(res, k, v)
    # the OOM killer sends SIGKILL; the cgroup's oom_kill counter says it was the cap, not something else
    res.oom_killed = res.oom_kill_count > 0 and res.killed_by_signal == "SIGKILL"
    return res


# ---- CLI ----
def _selftest() -> int:
    py = sys.executable
    cap = 256 << 20
    big = [py, "-c", "b = b'x' * (600 << 20); print(len(b))"]  # written bytes: really resident
    small = [py, "-c", "b = b'x' * (32 << 20); print(len(b))"]
    over = run_capped(big, cap)
    under = run_capped(small, cap)
    ok = over.oom_killed and over.returncode == -9 and under.returncode == 0 and not under.oom_killed
    ok = ok and 0 < under.max_usage_bytes <= cap and over.max_usage_bytes <= cap + PAGE
    print(json.dumps({"over_cap": over.summary(), "under_cap": under.summary(), "ok": ok}, indent=1))
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("evict", help="drop files from the page cache")
    e.add_argument("files", nargs="+")
    r = sub.add_parser("run", help="run a command in a memory cgroup")
    r.add_argument("--cap", required=True, help="memory limit, e.g. 8G (page cache included)")
    r.add_argument("--evict", action="append", default=[], help="evict this file first (repeatable)")
    r.add_argument("--timeout", type=float)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("selftest", help="check OOM detection with two tiny Python children")
    a = ap.parse_args(argv)
    if a.what == "evict":
        print(json.dumps({"cached_after_evict": evict_all(a.files)}))
        return 0
    if a.what == "selftest":
        return _selftest()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("run needs a command after --")
    left = evict_all(a.evict)
    res = run_capped(cmd, a.cap, capture=False, timeout=a.timeout)
    print(json.dumps({**res.summary(), "cached_after_evict": left}), file=sys.stderr)
    return res.returncode if isinstance(res.returncode, int) and res.returncode >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
