"""Start-up timeline: where the time to first token goes (STREAM_RUN_TIMING=1; off by default, then free).

mark(name) notes the seconds since the process started at a step of the start-up path (CLI ready, header
parsed, page-in started, kernels loaded, first token, ...), with optional figures (bytes read so far, ...).
At exit, one line goes to stderr: `timing: {"cli": 0.21, ...}` (JSON: name -> seconds, figures under their
own keys), which bench/cold_start.py reads. The start is STREAM_RUN_T0 (seconds since the epoch, set by a
harness just before it forks the process) if given, else the process's start time from /proc (10 ms ticks).
Stdlib only: it is imported before numpy.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

ENABLED = os.environ.get("STREAM_RUN_TIMING", "") not in ("", "0")
_marks: dict[str, float] = {}
_figures: dict[str, object] = {}


def _process_start() -> float:
    """The process's start, as seconds since the epoch (Linux /proc; else now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _t0() -> float:
    env = os.environ.get("STREAM_RUN_T0")
    try:
        return float(env) if env else _process_start()
    except ValueError:
        return _process_start()


_T0_EPOCH = _t0() if ENABLED else 0.0
_OFFSET = time.time() - time.perf_counter()  # perf_counter -> epoch


def since_start(t: float | None = None) -> float:
    """Seconds from the process's start to perf_counter() time t (default: now)."""
    return (time.perf_counter() if t is None else t) + _OFFSET - _T0_EPOCH


def mark(name: str, t: float | None = None, **figures) -> None:
    """Record step `name` at perf_counter() time t (default now), the first time only; figures are kept as given."""
    if not ENABLED:
        return
    _marks.setdefault(name, round(since_start(t), 4))
    _figures.update(figures)


def report() -> dict:
    return {**dict(sorted(_marks.items(), key=lambda kv: kv[1])), **_figures}


@atexit.register
def _print() -> None:
    if ENABLED and _marks:
        print("timing: " + json.dumps(report()), file=sys.stderr, flush=True)
