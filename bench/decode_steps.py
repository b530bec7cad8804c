#!/usr/bin/env python
"""Each decode step of a streamed MoE run on its own: wall time, time waited for expert reads, bytes read,
hit rate, cache slots used so far and the process's anonymous RSS (the expert cache growing into memory).

    python bench/decode_steps.py MODEL.gguf [--tg 32] [--pp 16] [--ram-budget 8G]

A 16-token random prompt, then greedy steps; the default budget unless --ram-budget. Drop the page cache first
for a cold run. Shows what a tok/s over a whole run hides: the first steps after a prompt grow the cache into
fresh memory (on a VM whose host took that memory back, each first touch is slow), the later ones are bound
by the reads.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamer.options import StreamOptions  # noqa: E402
from streamer.session import open_model  # noqa: E402


def anon_gib() -> float:
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--ram-budget")
    a = ap.parse_args()
    s = open_model(a.model, StreamOptions(ram_budget=a.ram_budget), n_ctx=a.pp + a.tg + 16)
    m, moe = s.model, s.moe
    cache = moe.source.cache
    layers = moe.traffic.layers

    def tot(name: str) -> float:
        return sum(getattr(x, name) for x in layers)

    st = m.new_state()
    t0 = time.perf_counter()
    logits = m.forward(np.random.default_rng(1).integers(1000, 100000, a.pp), st)
    print(f"prefill {a.pp}: {time.perf_counter() - t0:.1f} s, slots used {cache.touched_slots}/{cache.n_slots}, "
          f"anon RSS {anon_gib():.1f} GiB")  # fmt: skip
    steps = []
    for i in range(a.tg):
        b0, s0, r0 = tot("read_bytes") + tot("prefetch_bytes"), tot("stall_s"), tot("requests")
        h0 = tot("hit_lru") + tot("hit_pinned")
        t0 = time.perf_counter()
        logits = m.step([int(np.argmax(logits))], [st])[0]
        dt = time.perf_counter() - t0
        steps.append(dt)
        hit = (tot("hit_lru") + tot("hit_pinned") - h0) / max(tot("requests") - r0, 1)
        read = (tot("read_bytes") + tot("prefetch_bytes") - b0) / 1e9
        print(f"step {i:3d} {dt:6.2f} s  waited {tot('stall_s') - s0:5.2f} s  read {read:5.2f} GB  hit {hit:.2f}  "
              f"slots used {cache.touched_slots}/{cache.n_slots}  anon RSS {anon_gib():.1f} GiB", flush=True)  # fmt: skip
    print(f"{a.tg} steps: {a.tg / sum(steps):.3f} tok/s; median step {statistics.median(steps):.2f} s")


if __name__ == "__main__":
    main()
