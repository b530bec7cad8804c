"""A first run's kernel compile: `stream-run demo` (or any stream-run command) with an empty numba cache.

Each round runs the command once per source tree (alternating: --src DIR puts DIR first on PYTHONPATH, e.g. an
export of main beside a branch; none: the installed package) with a fresh NUMBA_CACHE_DIR, then once more
warm; prints per tree the wall time, the "compiling kernels ... done in X s" figure the command prints, and
the CPU seconds of the process and its children. Time it on a quiet machine.

    python bench/first_run.py --rounds 2 --src /tmp/main-src --src .        # A/B of the demo's first run
    python bench/first_run.py -- run MODEL.gguf -p hi -n 4                   # another command
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def once(cmd: list[str], src: str | None, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve())] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{err[-2000:]}")
    m = re.search(r"compiling kernels.*? done in ([\d.]+) s", err)
    return {"wall": wall, "compile": float(m.group(1)) if m else 0.0, "cpu": ru.ru_utime + ru.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--src", action="append", default=[], help="a source tree to put first on PYTHONPATH")
    ap.add_argument("command", nargs="*", default=["demo"], help="stream-run's arguments (default: demo)")
    a = ap.parse_args()
    exe = str(Path(sys.executable).parent / "stream-run")
    cmd = [exe] + a.command
    srcs = a.src or [None]
    got: dict = {s: {"cold": [], "warm": []} for s in srcs}
    root = tempfile.mkdtemp(prefix="first-run-")
    try:
        for r in range(a.rounds):
            for s in srcs:
                cache = os.path.join(root, f"nbc-{r}-{srcs.index(s)}")
                got[s]["cold"].append(once(cmd, s, cache))
                got[s]["warm"].append(once(cmd, s, cache))
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for s in srcs:
        for kind in ("cold", "warm"):
            rs = got[s][kind]
            med = {k: statistics.median(x[k] for x in rs) for k in ("wall", "compile", "cpu")}
            print(
                f"{s or 'installed'} {kind}: wall {med['wall']:.1f} s, compiling {med['compile']:.1f} s, "
                f"CPU {med['cpu']:.1f} s (median of {len(rs)})"
            )


if __name__ == "__main__":
    main()
