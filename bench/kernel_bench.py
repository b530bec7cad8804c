"""Kernel micro-benchmark: matvec (decode) and m=32 matmul (prefill) per weight format.

    python bench/kernel_bench.py [--threads 2] [--formats Q8_0,Q4_K] [--shapes 1024x3072,151936x1024]
    python bench/kernel_bench.py --decode-ab [--rounds 5] [--shapes 2048x768,151936x2048]

Prints weight-bytes throughput in GB/s (what decode speed is bound by) and GFLOP/s for matmul,
best and median of repeated calls. Weights are random valid blocks with sane f16 scales.
--decode-ab: the decode row dot old vs new, for each format with a digits version (blocks.DIGIT_CODES; vpdpbusd,
or its AVX2 form): the same block_matvec given the int16 activation buffer (the path without either), the
two-int8-digit one (the default) and the one-digit one (STREAM_RUN_ACT=int8), alternating in each round, single
thread (ns per 256-element super-block) and 2 threads (GB/s); best of the rounds.
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
    ap.add_argument("--decode-ab", action="store_true", help="int16 vs int8-digit decode row dots (see above)")
    ap.add_argument("--rounds", type=int, default=5, help="--decode-ab: alternating rounds")
    args = ap.parse_args()
    if args.decode_ab:
        shapes = args.shapes if args.shapes != ",".join(SHAPES) else "2048x768,151936x2048"
        decode_ab(shapes, args.rounds, args.time)
        return
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


def decode_ab(shapes: str, rounds: int, min_time: float) -> None:
    from streamer.kernels import blocks, int8

    if int8.DECODE_ISA is None:
        print("error: the digit row dots need AVX512-VNNI or AVX2 (and no STREAM_RUN_ISA=generic/f32)", file=sys.stderr)
        sys.exit(2)
    rng = np.random.default_rng(0)
    print(
        f"# decode row dot A/B {datetime.datetime.now():%Y-%m-%d %H:%M}, digits by {int8.DECODE_ISA}, best of {rounds}"
        " alternating rounds"
    )
    print(
        f"{'format':6} {'shape':>12} {'thr':>3} | {'int16 ns/sb':>11} {'GB/s':>6} | {'digits ns/sb':>12} {'GB/s':>6} |"
        f" {'1 digit ns/sb':>13} {'GB/s':>6} | int16/digits  digits/1 digit time"
    )
    for shape in shapes.split(","):
        n_out, n_in = map(int, shape.split("x"))
        x = rng.standard_normal(n_in, dtype=np.float32)
        out = np.empty(n_out, np.float32)
        aux = np.empty(3 * (n_in // 32) + 1, np.float32)
        xq = blocks.act_buffer(n_in).view(np.int16)  # 64-byte aligned
        bufs = {"int16": xq, "digits": xq.view(np.int8), "digit": xq.view(np.uint8)}
        for qtype, f in formats.FORMATS.items():
            if f.family != "block" or f.code not in blocks.DIGIT_CODES:
                continue
            q = QMatrix(make_weight(qtype, n_out, n_in, rng)[0], qtype, n_in, name=qtype.name)
            nsb = n_out * n_in / 256
            for threads in (1, 2):
                set_threads(threads)
                best = {k: float("inf") for k in bufs}
                for _ in range(rounds):
                    for k, buf in bufs.items():
                        t, _ = timeit(partial(blocks.block_matvec, f.code, q._w, x, out, buf, aux), min_time / rounds)
                        best[k] = min(best[k], t)
                a, b, c = best["int16"], best["digits"], best["digit"]
                print(
                    f"{qtype.name:6} {shape:>12} {threads:>3} | {a / nsb * 1e9:11.2f} {q.nbytes / a / 1e9:6.1f} | "
                    f"{b / nsb * 1e9:12.2f} {q.nbytes / b / 1e9:6.1f} | {c / nsb * 1e9:13.2f} {q.nbytes / c / 1e9:6.1f} "
                    f"| {a / b:12.2f}x {b / c:9.2f}x",
                    flush=True,
                )
            del q


if __name__ == "__main__":
    main()
