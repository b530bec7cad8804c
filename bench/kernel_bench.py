"""Kernel micro-benchmark: matvec (decode) and m=32 matmul (prefill) per weight format.

    python bench/kernel_bench.py [--threads 2] [--formats Q8_0,Q4_K] [--shapes 1024x3072,151936x1024]

Prints weight-bytes throughput in GB/s (what decode speed is bound by) and GFLOP/s for matmul,
best and median of repeated calls. Weights are random valid blocks with sane f16 scales.
"""

import argparse
import datetime
import platform
import sys
import time
from functools import partial
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

from streamer import formats
from streamer.kernels import QMatrix, set_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kernels import make_weight  # noqa: E402  (the tests' random valid blocks, sane f16 scales)

FORMATS = [t.name for t in formats.FORMATS]  # every format stream-run reads
SHAPES = ["1024x3072", "3072x1024", "151936x1024"]  # n_out x n_in: ffn_down, ffn_up/gate, head


def timeit(fn, min_time: float, min_reps: int = 5) -> tuple[float, float]:
    fn()  # compile / warm
    ts = []
    t_end = time.perf_counter() + min_time
    while len(ts) < min_reps or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", type=int, default=32, help="activation rows for matmul")
    ap.add_argument("--time", type=float, default=0.5, help="seconds per measurement")
    ap.add_argument("--no-matmul", action="store_true")
    args = ap.parse_args()
    set_threads(args.threads)
    rng = np.random.default_rng(0)
    print(
        f"# kernel_bench {datetime.datetime.now():%Y-%m-%d %H:%M}  threads={args.threads}  "
        f"{platform.processor() or platform.machine()}  numba {numba.__version__}"
    )
    print(
        f"{'format':6} {'shape':>12} {'MB':>7} | {'matvec GB/s best':>16} {'med':>6} {'us':>8} | "
        f"{f'matmul m={args.m} GB/s':>16} {'GFLOP/s':>8} {'med':>6}"
    )
    for shape in args.shapes.split(","):
        n_out, n_in = map(int, shape.split("x"))
        x = rng.standard_normal(n_in, dtype=np.float32)
        X = rng.standard_normal((args.m, n_in), dtype=np.float32)
        out = np.empty(n_out, np.float32)
        OUT = np.empty((args.m, n_out), np.float32)
        for name in args.formats.split(","):
            qtype = T[name]
            q = QMatrix(make_weight(qtype, n_out, n_in, rng)[0], qtype, n_in, name=name)
            gb = q.nbytes / 1e9
            best, med = timeit(partial(q.matvec, x, out), args.time)
            line = f"{name:6} {shape:>12} {q.nbytes / 1e6:7.1f} | {gb / best:16.2f} {gb / med:6.2f} {best * 1e6:8.0f} |"
            if not args.no_matmul:
                flop = 2.0 * args.m * n_out * n_in
                best, med = timeit(partial(q.matmul, X, OUT), args.time, min_reps=2)
                line += f" {gb / best:16.2f} {flop / best / 1e9:8.1f} {flop / med / 1e9:6.1f}"
            print(line, flush=True)
            del q


if __name__ == "__main__":
    main()
