#!/usr/bin/env python3
"""A/B of the MoE prefill's expert paths in one process: each layer's FFN on one chunk of tokens (the model's own
router on random hidden states), under two or more splits of the experts between the paths, alternating, whole
model resident. A split is NAME=GROUPED_MAX,LANES_MAX: experts with at most GROUPED_MAX tokens by the int16 row
dots, then up to LANES_MAX by lanes.grouped, the rest by the integer tiles. Default: "rowdots=3,16" (the 1..3-token
experts by row dots, the default since 2026-12-01) against "lanes=0,16" (every expert up to 16 tokens in lanes).

    python bench/moe_prefill_ab.py /work/models/qwen3-30b-a3b-4L-Q4_K.gguf [-m 128] [-t 2] [--rounds 7]
    python bench/moe_prefill_ab.py MODEL --split tiles=3,0 --split lanes=3,16

Prints the best and median FFN time per chunk (all layers) of each, and each one's ratio to the first.
"""

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-m", type=int, default=128, help="tokens in the chunk")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers (0: all)")
    ap.add_argument("--split", action="append", help="NAME=GROUPED_MAX,LANES_MAX (repeat; default two, see above)")
    args = ap.parse_args()
    from streamer.kernels import set_threads
    from streamer.options import StreamOptions
    from streamer.session import open_model

    set_threads(args.threads)
    s = open_model(args.model, StreamOptions(stream=False, learn=False))
    cfg, moe = s.cfg, s.moe
    layers = range(args.layers or cfg.n_layer)
    rng = np.random.default_rng(0)
    hs = [rng.standard_normal((args.m, cfg.n_embd)).astype(np.float32) for _ in layers]
    splits = args.split or ["rowdots=3,16", "lanes=0,16"]
    variants = {n: sv.split(",") for n, sv in (x.split("=") for x in splits)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    outs = {}
    for r in range(args.rounds + 1):
        for name, (gm, lm) in variants.items():
            moe.grouped_max, moe.lanes_max = int(gm), int(lm)
            t = time.perf_counter()
            outs[name] = [moe(layer, h) for layer, h in zip(layers, hs)]
            if r:  # round 0 warms up (page-in, kernels)
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: best {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms per chunk")
    first = next(iter(times))
    a, x0 = times[first], outs[first]
    for name in list(times)[1:]:
        b = times[name]
        ratio = f"best {min(a) / min(b):.3f}x  median {statistics.median(a) / statistics.median(b):.3f}x"
        print(f"{name} speed-up over {first}: {ratio}")
        err = max(float(np.abs(x - y).max() / np.abs(x).max()) for x, y in zip(x0, outs[name]))
        print(f"largest relative difference {name} vs {first}: {err:.2e}")
    s.close()


if __name__ == "__main__":
    main()
