#!/usr/bin/env python3
"""The MoE prefill's expert products at one layer of the 30B-A3B geometry: lanes.grouped (weights read once per
row, the tokens in lanes) against int8.grouped_matmul (unpacked weight tiles), alternating rounds.

    python bench/lanes_bench.py [--tokens 128] [--threads 2] [--rounds 5] [--min 4] [--max 16] [--split-ab]
                                [--isa vnni|generic|f32]

--isa f32 (the default on a CPU without AVX512-VNNI) times the f32 tiles (grouped.grouped_matmul, what MoEFFN
runs there) against the lanes on lanes.host_isa()'s ISA (AVX2 there).

A random top-8 routing of --tokens tokens over 128 experts; the experts with --min..--max tokens are computed
(gate + up: 768 x 2048 each; down: 2048 x 768; all Q4_K, random valid blocks, 340 MB: read from RAM). Prints
the best time of each per matrix kind, and the ratio. Includes each path's activation gather / lane packing.
"""

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

from streamer.formats import FORMATS
from streamer.kernels import grouped, int8, lanes, set_threads
from streamer.kernels.gemm import TILE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kernels import make_weight  # noqa: E402

Q4_K = FORMATS[T.Q4_K].code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min", type=int, default=4)
    ap.add_argument("--max", type=int, default=16)
    ap.add_argument("--isa", default=int8.ISA or "f32", choices=int8.usable_isas() + ["f32"])
    ap.add_argument("--split-ab", action="store_true", help="also time lanes.grouped without lanes.SPLIT's two passes")
    args = ap.parse_args()
    set_threads(args.threads)
    rng = np.random.default_rng(0)
    E, k, d, f = 128, 8, 2048, 768
    ids = np.array([rng.choice(E, k, replace=False) for _ in range(args.tokens)])
    cnt = np.bincount(ids.reshape(-1), minlength=E)
    sel = np.flatnonzero((cnt >= args.min) & (cnt <= args.max))
    toks = [np.flatnonzero((ids == e).any(axis=1)) for e in sel]
    g = len(sel)
    lisa = args.isa if args.isa != "f32" else lanes.host_isa() or "generic"
    print(
        f"# {g} experts with {args.min}..{args.max} of {args.tokens} tokens ({cnt[sel].sum()} pairs), "
        f"tiles {args.isa}, lanes {lisa}"
    )
    one_gu = make_weight(T.Q4_K, f, d, rng)[0].view(np.uint8).reshape(-1)
    one_dn = make_weight(T.Q4_K, d, f, rng)[0].view(np.uint8).reshape(-1)
    base = np.empty(3 * g * one_gu.size, np.uint8)
    for i in range(3 * g):
        base[i * one_gu.size : (i + 1) * one_gu.size] = one_dn if i >= 2 * g else one_gu
    base.flags.writeable = False
    offs = np.arange(3 * g, dtype=np.int64) * one_gu.size
    gu_offs, dn_offs = offs[: 2 * g].reshape(2, g), offs[2 * g :].reshape(1, g)
    rb_gu, rb_dn = one_gu.size // f, one_dn.size // d
    X = rng.standard_normal((args.tokens, d)).astype(np.float32)
    n = np.array([len(t) for t in toks])
    starts = np.concatenate(([0], np.cumsum(n))).astype(np.int64)
    rows = np.concatenate(toks).astype(np.int64)
    rstarts = np.concatenate(([0], np.cumsum(-(-n // int8.N_TOK) * int8.N_TOK)))
    R = int(rstarts[-1])
    tok = np.full(R, -1, np.int64)
    tok[np.arange(len(rows)) + np.repeat(rstarts[:-1] - starts[:-1], n)] = rows
    hq = int8.quantize(Q4_K, X)
    A = rng.standard_normal((R, f)).astype(np.float32)
    aq = int8.quantize(Q4_K, A)
    P = int(starts[-1])
    arows = np.arange(P, dtype=np.int64)

    scratch = {K: np.empty((numba.config.NUMBA_NUM_THREADS, TILE, K), np.float32) for K in (d, f)}

    def tiles_gu():
        out = np.empty((2, R, f), np.float32)
        if args.isa == "f32":  # the rows gathered, as moe_compute.Fused._grouped_mm without the integer kernel
            x = np.zeros((R, d), np.float32)
            x[tok >= 0] = X[tok[tok >= 0]]
            grouped.grouped_matmul(Q4_K, base, gu_offs, rb_gu, x, rstarts, out, scratch[d])
        else:
            int8.grouped_matmul(Q4_K, base, gu_offs, rb_gu, int8.gather(hq, tok), rstarts, out, args.isa)

    def lanes_gu():
        out = np.empty((2, P, f), np.float32)
        lanes.grouped(base, gu_offs, rb_gu, hq, rows, starts, out, lisa)

    def tiles_dn():
        out = np.empty((1, R, d), np.float32)
        if args.isa == "f32":
            grouped.grouped_matmul(Q4_K, base, dn_offs, rb_dn, A, rstarts, out, scratch[f])
        else:
            int8.grouped_matmul(Q4_K, base, dn_offs, rb_dn, aq, rstarts, out, args.isa)

    def lanes_dn():
        out = np.empty((1, P, d), np.float32)
        lanes.grouped(base, dn_offs, rb_dn, aq, arows, starts, out, lisa)

    fns = {"tiles gate+up": tiles_gu, "lanes gate+up": lanes_gu, "tiles down": tiles_dn, "lanes down": lanes_dn}
    if args.split_ab:  # the same lanes calls with every expert in one pass (lanes.SPLIT off), alternating

        def unsplit(fn):
            def run():
                keep = lanes.SPLIT, lanes.SPLIT_AVX2
                lanes.SPLIT = lanes.SPLIT_AVX2 = (1, 0)
                try:
                    fn()
                finally:
                    lanes.SPLIT, lanes.SPLIT_AVX2 = keep

            return run

        fns["lanes 1-pass gate+up"], fns["lanes 1-pass down"] = unsplit(lanes_gu), unsplit(lanes_dn)
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    for name, t in best.items():
        print(f"{name:14} {t * 1e3:8.2f} ms")
    for kind in ("gate+up", "down"):
        print(f"lanes / tiles {kind}: {best[f'tiles {kind}'] / best[f'lanes {kind}']:.2f}x faster")
        if args.split_ab:
            print(f"lanes split / 1-pass {kind}: {best[f'lanes 1-pass {kind}'] / best[f'lanes {kind}']:.2f}x faster")


if __name__ == "__main__":
    main()
