"""Prefill matmul micro-benchmark: the integer kernel (kernels/int8.py) vs the f32 tiles (blocks.block_matmul).

    python bench/int8_bench.py [--threads 2] [--m 128] [--formats Q8_0,Q4_K] [--shapes 3072x1024,1024x3072]
                               [--isas vnni,generic] [--digits 2,1] [--rounds 5]

Per format and shape (n_out x n_in): GFLOP/s (2 m n_out n_in per call) and weight GB/s, best of --rounds
alternating rounds (f32, then each ISA, in turn, so a busy machine slows all alike), and the speed ratio to the
f32 tiles. --digits: activations as two int8 digits (the default, int16-fine) and/or one (ggml's int8,
STREAM_RUN_ACT=int8). Weights are the tests' random valid blocks (tests/test_kernels.make_weight).
"""

import argparse
import datetime
import sys
import time
from functools import partial
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

from streamer.formats import FORMATS
from streamer.kernels import blocks, int8, set_threads
from streamer.kernels.dispatch import INT8, _tile_scratch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kernels import make_weight  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--m", type=int, default=128, help="activation rows (tokens)")
    ap.add_argument("--formats", default=",".join(sorted(t.name for t in INT8)))
    ap.add_argument("--shapes", default="3072x1024,1024x3072,768x2048,2048x768")
    ap.add_argument("--isas", default=",".join(int8.usable_isas()))
    ap.add_argument("--digits", default="2,1", help="int8 digits per activation: 2 (default path), 1 (int8)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    set_threads(args.threads)
    isas = [(i, int(d)) for i in args.isas.split(",") if i for d in args.digits.split(",")]
    print(
        f"# int8_bench {datetime.datetime.now():%Y-%m-%d %H:%M}  threads={args.threads}  m={args.m}  "
        f"numba {numba.__version__}  host ISA: {int8.ISA or 'f32 tiles'}"
    )
    print(
        f"{'format':6} {'shape':>10} | {'f32 GF/s':>8} {'GB/s':>6} | "
        + " | ".join(f"{f'{i}/{d}d GF/s':>14} {'GB/s':>6} {'x f32':>6}" for i, d in isas)
    )
    rng = np.random.default_rng(0)
    for name in args.formats.split(","):
        qtype = T[name]
        code = FORMATS[qtype].code
        for shape in args.shapes.split(","):
            n_out, n_in = map(int, shape.split("x"))
            data, _ = make_weight(qtype, n_out, n_in, rng)
            w = data.view(np.uint8)
            w.flags.writeable = False
            X = rng.standard_normal((args.m, n_in)).astype(np.float32)
            out = np.empty((args.m, n_out), np.float32)
            fns = {"f32": partial(blocks.block_matmul, code, w, X, out, _tile_scratch(n_in))}
            for isa, d in isas:
                if int8.serves(code, isa):  # avx2: Q4_0 and Q4_K only
                    fns[isa, d] = partial(int8.matmul, code, w, X, out, isa, d)
            for f in fns.values():
                f()  # compile / warm
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(args.rounds):
                for k, f in fns.items():
                    t = time.perf_counter()
                    f()
                    best[k] = min(best[k], time.perf_counter() - t)
            flop, nbytes = 2 * args.m * n_out * n_in, w.nbytes
            cells = [f"{flop / best['f32'] / 1e9:8.0f} {nbytes / best['f32'] / 1e9:6.2f}"]
            for key in isas:
                t = best.get(key)
                cells.append(
                    f"{flop / t / 1e9:14.0f} {nbytes / t / 1e9:6.2f} {best['f32'] / t:6.2f}" if t else f"{'-':>28}"
                )
            print(f"{name:6} {shape:>10} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
