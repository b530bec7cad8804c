"""bench/cold_start.py's disk timeline: DiskActivity.summary over samples of a block device's stat file (the
seconds to the first read, the busy seconds, the bytes read and the idle gaps after the first read), checked
on hand-made samples, and once live on a file read while it samples."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cold_start  # noqa: E402


def test_summary_of_hand_made_samples(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    d = cold_start.DiskActivity(str(f))
    t0 = 100.0
    # (epoch, sectors read, in flight, io_ticks ms): idle, reading from 100.1, a gap 100.3-100.4, reading to 100.5
    d.samples = [(100.00, 0, 0, 0), (100.05, 0, 0, 0), (100.10, 8, 2, 50), (100.20, 16, 1, 150), (100.30, 24, 0, 240),
                 (100.35, 24, 0, 240), (100.40, 32, 3, 250), (100.50, 40, 0, 340), (100.51, 40, 0, 340)]  # fmt: skip
    s = d.summary(t0, gap=0.02)
    assert s["disk_first_read_s"] == 0.1 and s["disk_busy_s"] == 0.34 and s["disk_read_bytes"] == 40 * 512
    assert s["disk_idle_gaps"] == [(0.3, 0.4)] and s["disk_idle_s"] == 0.1  # the trailing idle sample is no gap yet
    assert d.summary(t0, gap=0.2)["disk_idle_gaps"] == []  # shorter than `gap`: not listed
    d.samples = d.samples[:2]  # nothing read
    assert d.summary(t0)["disk_first_read_s"] is None and d.summary(t0)["disk_idle_gaps"] == []


def test_live_samples_see_a_read(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(os.urandom(1 << 20))
    d = cold_start.DiskActivity(str(f), period=0.001)
    if not os.path.exists(d.file):  # tmpfs, overlay: no block device to sample
        return
    t0 = time.time()
    with d:
        time.sleep(0.01)
    s = d.summary(t0)
    assert len(d.samples) >= 3 and s["disk_busy_s"] >= 0 and s["disk_read_bytes"] >= 0
    assert all(a[0] <= b[0] for a, b in zip(d.samples, d.samples[1:]))
