#!/usr/bin/env python
"""The expert cache's arena in 2 MiB pages (numpy's advice for a large array) against 4 KiB pages (arena_empty).

    python bench/arena_pages.py [--model PATH] [--gib 1] [--rounds 3] [--kernels]

Alternating rounds, each on fresh memory (a new arena per measurement, released after it):
- touch: the first write of one byte per 4 KiB page of a --gib arena, GB/s. The page faults are the work here:
  a 2 MiB page is zeroed whole at its first fault.
- fill:  what a cold prompt does to the arena. The model file is evicted from the page cache, then random
  experts (any layer) are read into consecutive slots with streamer.experts.store's ExpertReader (O_DIRECT
  where the filesystem allows), by --readers threads, until --gib is filled. The rate is in GB/s of expert
  bytes.
- --kernels: the decode's multi-expert kernels (experts_matvec for gate and up, then experts_down) over 8
  random slots a layer for 48 layers, reading an arena of --kernel-slots experts copied from layer 0. Median
  and best milliseconds per 48 layers.

Run it on a quiet machine as root (the eviction needs it for files it does not own).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cgroup  # noqa: E402  (bench/cgroup.py: evict_all)

from streamer.buffers import aligned_empty, arena_empty  # noqa: E402
from streamer.config import ModelConfig  # noqa: E402
from streamer.experts.store import ExpertLayout, ExpertReader  # noqa: E402
from streamer.gguf_file import GGUFFile  # noqa: E402

KINDS = {"2 MiB pages": aligned_empty, "4 KiB pages": arena_empty}


def touch_gb_s(make, nbytes: int) -> float:
    a = make(nbytes)
    t = time.perf_counter()
    a[::4096] = 1
    return nbytes / (time.perf_counter() - t) / 1e9


def fill_gb_s(make, gf, layout: ExpertLayout, nbytes: int, readers: int, seed: int) -> float:
    n = nbytes // layout.slot_bytes
    arena = make(n * layout.slot_bytes).reshape(n, layout.slot_bytes)
    rng = np.random.default_rng(seed)
    keys = [(int(rng.integers(layout.n_layer)), int(rng.integers(layout.n_expert))) for _ in range(n)]
    cgroup.evict_all(path for path, _ in gf.files)
    reader = ExpertReader(gf.files, layout)
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            list(pool.map(lambda i: reader.read(*keys[i], arena[i]), range(n)))
        dt = time.perf_counter() - t
    finally:
        reader.close()
    return sum(layout.expert_bytes(layer) for layer, _ in keys) / dt / 1e9


def kernel_ms(gf, cfg, layout: ExpertLayout, n_slots: int, rounds: int) -> dict[str, list[float]]:
    from streamer.kernels.experts import FORMATS, ExpertScratch, experts_down, experts_matvec

    ps, k = layout.parts[0], cfg.n_expert_used
    src = np.asarray(gf.mm)
    arenas = {}
    for name, make in KINDS.items():
        a = make(n_slots * layout.slot_bytes).reshape(n_slots, layout.slot_bytes)
        offs = np.empty((n_slots, 3), np.int64)
        rng = np.random.default_rng(0)
        for s in range(n_slots):
            e, pos = int(rng.integers(cfg.n_expert)), 0
            for j, p in enumerate(ps):
                a[s, pos : pos + p.nbytes] = src[p.offset + e * p.nbytes : p.offset + (e + 1) * p.nbytes]
                offs[s, j] = s * layout.slot_bytes + pos
                pos += -(-p.nbytes // 4096) * 4096
        flat = a.reshape(-1)
        flat.flags.writeable = False
        arenas[name] = (flat, offs)
    gfmt, dfmt = FORMATS[ps[0].qtype], FORMATS[ps[2].qtype]
    grb, drb = ps[0].nbytes // ps[0].n_rows, ps[2].nbytes // ps[2].n_rows
    sx, sa = ExpertScratch(1, cfg.n_embd), ExpertScratch(k, cfg.n_ff_exp)
    x = np.random.default_rng(1).standard_normal(cfg.n_embd).astype(np.float32)
    gu = np.empty((2 * k, cfg.n_ff_exp), np.float32)
    a_in = np.random.default_rng(2).standard_normal((k, cfg.n_ff_exp)).astype(np.float32)
    out, w = np.zeros(cfg.n_embd, np.float32), np.full(k, 1.0 / k, np.float32)

    def step(name: str, rng) -> float:
        flat, offs = arenas[name]
        picks = [offs[rng.choice(n_slots, k, replace=False)] for _ in range(48)]
        t = time.perf_counter()
        for o in picks:
            experts_matvec(gfmt, flat, np.concatenate((o[:, 0], o[:, 1])), grb, x, gu, sx.xq[0], sx.aux[0])
            experts_down(dfmt, flat, np.ascontiguousarray(o[:, 2]), drb, a_in, w, out, sa.xq, sa.aux)
        return (time.perf_counter() - t) * 1e3

    rng = np.random.default_rng(3)
    names = list(KINDS)
    for name in names:  # compile and settle
        step(name, rng)
    res: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            res[name].append(step(name, rng))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/models/qwen3-30b-a3b-Q4_K.gguf")
    ap.add_argument("--gib", type=float, default=1.0, help="arena size of the touch and fill measurements")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--readers", type=int, default=8, help="reader threads of the fill (the run command's default)")
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between measurements (memory released settles)")
    ap.add_argument("--kernels", action="store_true", help="also time the decode kernels over each arena")
    ap.add_argument("--kernel-slots", type=int, default=600)
    ap.add_argument("--kernel-rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"error: no such model file {args.model}", file=sys.stderr)
        return 2
    gf = GGUFFile(args.model)
    cfg = ModelConfig.from_gguf(gf)
    if cfg.n_expert == 0:
        print(f"error: {args.model} has no experts", file=sys.stderr)
        return 2
    layout = ExpertLayout(gf, cfg)
    nbytes = int(args.gib * 2**30)
    names = list(KINDS)
    touch: dict[str, list[float]] = {n: [] for n in names}
    fill: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            time.sleep(args.pause)
            touch[name].append(touch_gb_s(KINDS[name], nbytes))
            time.sleep(args.pause)
            fill[name].append(fill_gb_s(KINDS[name], gf, layout, nbytes, args.readers, seed=r))
            print(f"round {r} {name}: touch {touch[name][-1]:.2f} GB/s, fill {fill[name][-1]:.2f} GB/s", flush=True)
    for name in names:
        print(f"{name}: touch median {median(touch[name]):.2f} GB/s ({' '.join(f'{v:.2f}' for v in touch[name])}), "
              f"fill median {median(fill[name]):.2f} GB/s ({' '.join(f'{v:.2f}' for v in fill[name])})")  # fmt: skip
    if args.kernels:
        res = kernel_ms(gf, cfg, layout, args.kernel_slots, args.kernel_rounds)
        for name, v in res.items():
            print(f"kernels, {name}: median {median(v):.2f} ms per 48 layers, best {min(v):.2f}")
        a, b = (median(res[n]) for n in names)
        print(f"kernels: 4 KiB / 2 MiB pages, medians: {b / a:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
