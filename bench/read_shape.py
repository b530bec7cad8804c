#!/usr/bin/env python
"""What an expert costs to read as three preads (gate, up, down: three tensors, today's layout) against one
pread of the same bytes (an expert-major file would hold them together), with O_DIRECT as the runtime reads.

    python bench/read_shape.py MOE.gguf [--experts 600] [--threads 8] [--rounds 3]

Per round, the same random (layer, expert) list is read both ways by --threads reader threads, as the
runtime's ReaderPool does (the order of the two ways alternating between rounds). "one read" reads the
expert's byte count from the start of its gate slab: the same bytes per read, contiguous, at a random
place in the file, which is what a sidecar file would give. Prints per way the median wall time, GB/s and
experts/s, and the ratio. O_DIRECT bypasses the page cache, so no eviction is needed between rounds.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from streamer.buffers import ALIGN  # noqa: E402
from streamer.config import ModelConfig  # noqa: E402
from streamer.experts.store import ExpertLayout, aligned_span  # noqa: E402
from streamer.gguf_file import GGUFFile  # noqa: E402


def spans(layout: ExpertLayout, layer: int, e: int, joined: bool) -> list[tuple[int, int]]:
    """(aligned file offset, length) of each read of expert (layer, e) of a single-file model."""
    parts = layout.parts[layer]
    if joined:  # one read of the expert's bytes, from where its gate starts
        start = parts[0].offset + e * parts[0].nbytes
        a0, alen, _ = aligned_span(start, sum(p.nbytes for p in parts))
        return [(a0, alen)]
    out = []
    for p in parts:
        a0, alen, _ = aligned_span(p.offset + e * p.nbytes, p.nbytes)
        out.append((a0, alen))
    return out


def read_all(fd: int, jobs: list, threads: int, slot: int) -> float:
    bufs = [mmap.mmap(-1, slot) for _ in range(threads)]  # page-aligned, as the cache's arena
    free = list(range(threads))

    def one(sp):
        i = free.pop()
        try:
            mv, pos = memoryview(bufs[i]), 0
            for off, n in sp:
                os.preadv(fd, [mv[pos : pos + n]], off)
                pos += n
        finally:
            free.append(i)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, jobs))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--experts", type=int, default=600)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    gf = GGUFFile(a.model)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    if len(gf.files) != 1:
        sys.exit("a single-file model, please")
    fd = os.open(a.model, os.O_RDONLY | os.O_DIRECT)
    rng = np.random.default_rng(0)
    slot = layout.slot_bytes + 2 * ALIGN
    nbytes = 0
    times: dict[str, list] = {"three reads": [], "one read": []}
    for r in range(a.rounds):
        keys = [(int(rng.integers(cfg.n_layer)), int(rng.integers(cfg.n_expert))) for _ in range(a.experts)]
        nbytes = sum(layout.expert_bytes(layer) for layer, _ in keys)
        order = ("three reads", "one read") if r % 2 == 0 else ("one read", "three reads")
        for way in order:
            jobs = [spans(layout, layer, e, way == "one read") for layer, e in keys]
            times[way].append(read_all(fd, jobs, a.threads, slot))
            print(f"round {r + 1} {way}: {times[way][-1]:.2f} s", flush=True)
    os.close(fd)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(
            f"{k}: median {med[k]:.2f} s (range {min(v):.2f}-{max(v):.2f}), {nbytes / med[k] / 1e9:.2f} GB/s, "
            f"{a.experts / med[k]:.0f} experts/s"
        )
    print(f"one read / three reads, experts/s: {med['three reads'] / med['one read']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
