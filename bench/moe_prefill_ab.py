#!/usr/bin/env python3
"""A/B of the MoE prefill's expert paths in one process: each layer's FFN on one chunk of tokens (the model's own
router on random hidden states), with lanes.grouped for the experts with 4..16 tokens (lanes_max 16) against
the unpacked-tile integer kernel for them (lanes_max 0), alternating, whole model resident.

    python bench/moe_prefill_ab.py /work/models/qwen3-30b-a3b-4L-Q4_K.gguf [-m 128] [-t 2] [--rounds 7]

Prints the best and median FFN time per chunk (all layers) of each, and their ratio.
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
    variants = {"tiles": 0, "lanes": 16}
    times: dict[str, list[float]] = {k: [] for k in variants}
    outs = {}
    for r in range(args.rounds + 1):
        for name, lm in variants.items():
            moe.lanes_max = lm
            t = time.perf_counter()
            outs[name] = [moe(layer, h) for layer, h in zip(layers, hs)]
            if r:  # round 0 warms up (page-in, kernels)
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: best {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms per chunk")
    a, b = times["tiles"], times["lanes"]
    print(f"lanes speed-up: best {min(a) / min(b):.3f}x  median {statistics.median(a) / statistics.median(b):.3f}x")
    err = max(float(np.abs(x - y).max() / np.abs(x).max()) for x, y in zip(outs["tiles"], outs["lanes"]))
    print(f"largest relative difference lanes vs tiles: {err:.2e}")
    s.close()


if __name__ == "__main__":
    main()
