#!/usr/bin/env python
"""How fast this disk serves random expert reads by how many are in flight: the runtime's ExpertReader
(O_DIRECT) from reader threads, an expert a job (its gate, up and down in turn, as the runtime reads) or a
part a job, rounds alternating the configurations' order.

    python bench/read_depth.py MOE.gguf [--configs 4e,8e,16e,32e,8p,16p,32p] [--experts 300] [--rounds 3]

A config is a thread count and e (an expert a job) or p (a part a job). O_DIRECT bypasses the page cache, so
nothing needs evicting between rounds. Prints per config the median GB/s and every round's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamer.buffers import aligned_empty  # noqa: E402
from streamer.config import ModelConfig  # noqa: E402
from streamer.experts.store import ExpertLayout, ExpertReader, aligned_span  # noqa: E402
from streamer.gguf_file import GGUFFile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--configs", default="4e,8e,16e,32e,8p,16p,32p")
    ap.add_argument("--experts", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    configs = [(int(c[:-1]), c[-1]) for c in a.configs.split(",")]
    gf = GGUFFile(a.model)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    reader = ExpertReader(gf.files, layout, True)
    rng = np.random.default_rng(0)
    gbs: dict = {c: [] for c in configs}
    local = threading.local()

    def buf() -> np.ndarray:  # a slot per thread
        if not hasattr(local, "b"):
            local.b = aligned_empty(layout.slot_bytes)
        return local.b

    def part(layer: int, e: int, j: int) -> None:
        p = layout.parts[layer][j]
        a0, alen, _ = aligned_span(p.offset - reader.bases[p.shard] + e * p.stride, p.nbytes)
        os.preadv(reader.dfds[p.shard], [memoryview(buf())[:alen]], a0)

    for r in range(a.rounds):
        for threads, shape in configs if r % 2 == 0 else configs[::-1]:
            keys = [(int(rng.integers(cfg.n_layer)), int(rng.integers(cfg.n_expert))) for _ in range(a.experts)]
            if shape == "e":
                jobs = [lambda k=k: reader.read(k[0], k[1], buf()) for k in keys]
            else:
                jobs = [lambda k=k, j=j: part(k[0], k[1], j) for k in keys for j in range(3)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda f: f(), jobs))
            gbs[(threads, shape)].append(
                sum(layout.expert_bytes(k[0]) for k in keys) / (time.perf_counter() - t0) / 1e9
            )
    for (threads, shape), v in gbs.items():
        print(f"{threads:3d} threads, {'an expert' if shape == 'e' else 'a part'} a job: median {statistics.median(v):.2f} "
              f"GB/s ({' '.join(f'{x:.2f}' for x in v)})")  # fmt: skip


if __name__ == "__main__":
    main()
