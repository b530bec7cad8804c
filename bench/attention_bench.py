"""The attention kernel against its plain-loop version, per position: decode (one token) and a prefill chunk.

    python bench/attention_bench.py [--heads 32/4/128] [--positions 16,140,511,1023,2047] [--rounds 5]

ops.attention (score blocks and value sums in registers, kernels/simd_attn.py) and ops._attention_loops (the
plain loops: what ops.attention was before, and still is for a head_dim that is not a multiple of 16) on the
same random float16 cache, alternating in every round; median and best microseconds per call (one layer's
attention), and the ratio of the medians. Default geometry: Qwen3-30B-A3B's (32 query heads, 4 KV heads,
head_dim 128). Runs under the project's venv.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np

from streamer.kernels import ops, set_threads


def timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/4/128", help="query heads / KV heads / head_dim")
    ap.add_argument("--positions", default="16,140,511,1023,2047", help="decode positions (cached tokens before)")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk tokens (at position 0)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    nh, nkv, hd = (int(v) for v in a.heads.split("/"))
    positions = [int(p) for p in a.positions.split(",")]
    set_threads(a.threads)
    rng = np.random.default_rng(0)
    n_ctx = max(positions + [a.chunk]) + 1
    kc = rng.standard_normal((nkv, n_ctx, hd)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((nkv, n_ctx, hd)).astype(np.float16).view(np.uint16)
    scale = np.float32(1 / np.sqrt(hd))
    cases = [(1, p) for p in positions] + [(a.chunk, 0)]
    print(f"{nh} query heads, {nkv} KV heads, head_dim {hd}, {a.threads} threads, {a.rounds} rounds (us per call)")
    for m, pos in cases:
        q = rng.standard_normal((m, nh, hd)).astype(np.float32)
        out = np.empty_like(q)
        args = (q, kc, vc, pos, scale, out)
        fns = {"kernel": partial(ops.attention, *args), "loops": partial(ops._attention_loops, *args)}
        for f in fns.values():
            f()  # compile / warm
        reps = max(3, int(2e4 / (pos + m)))
        res = {k: [] for k in fns}
        for r in range(a.rounds):
            for k in fns if r % 2 == 0 else reversed(list(fns)):
                res[k].append(timed(fns[k], reps))
        med = {k: statistics.median(v) for k, v in res.items()}
        what = f"decode at position {pos}" if m == 1 else f"prefill {m} tokens"
        print(
            f"{what:26s} kernel {med['kernel']:8.1f} (best {min(res['kernel']):8.1f})  "
            f"loops {med['loops']:8.1f} (best {min(res['loops']):8.1f})  loops / kernel {med['loops'] / med['kernel']:.2f}x"
        )


if __name__ == "__main__":
    main()
