"""bench/cgroup.py's settle: it waits until the free page reporting counter has not moved for `quiet` seconds
(counting the KiB reported meanwhile), gives up at `limit`, and returns at once where there is no counter."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cgroup  # noqa: E402


def put(path: Path, n: int) -> None:
    """Write the counter atomically, as sysfs shows it (a plain rewrite would show a reader an empty file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{n}\n")
    tmp.replace(path)


def test_settle_waits_for_the_counter_to_stop_then_for_quiet_seconds(tmp_path):
    counter = tmp_path / "reported_kib"
    put(counter, 1000)
    stop = threading.Event()

    def report():  # 2048 KiB every 20 ms for 0.3 s, then nothing
        n, t0 = 1000, time.monotonic()
        while time.monotonic() - t0 < 0.3 and not stop.is_set():
            time.sleep(0.02)
            n += 2048
            put(counter, n)

    t = threading.Thread(target=report)
    t.start()
    try:
        waited, mib = cgroup.settle(0.2, counter=str(counter), poll=0.01)
    finally:
        stop.set()
        t.join()
    final = (int(counter.read_text()) - 1000) / 1024
    # the 0.3 s of reports, then 0.2 s of quiet; settle's clock starts after the reporter's, a few ms later on a
    # busy machine (CI measured 0.498 s once), so the lower bound leaves 50 ms
    assert 0.45 <= waited < 2.0
    assert mib == final and mib >= 10  # every report before the quiet counted


def test_settle_gives_up_at_the_limit_and_returns_at_once_without_a_counter(tmp_path):
    counter = tmp_path / "reported_kib"
    put(counter, 0)
    stop = threading.Event()

    def report():
        n = 0
        while not stop.is_set():
            n += 1
            put(counter, n)
            time.sleep(0.005)

    t = threading.Thread(target=report)
    t.start()
    try:
        waited, _ = cgroup.settle(0.2, limit=0.3, counter=str(counter), poll=0.01)
    finally:
        stop.set()
        t.join()
    assert 0.3 <= waited < 1.0
    t0 = time.monotonic()
    assert cgroup.settle(5, counter=str(tmp_path / "missing")) == (0.0, 0.0) and time.monotonic() - t0 < 0.1
