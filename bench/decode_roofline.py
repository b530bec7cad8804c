#!/usr/bin/env python3
"""The decode roofline of a GGUF model in RAM: weight bytes one decode step reads, this machine's memory read
ceiling on 1 and 2 threads, and hence the tok/s no decoder reading those weights from RAM can beat.

    python bench/decode_roofline.py /work/models/qwen3-30b-a3b-Q4_K.gguf [--tok-s NAME=15.7 ...]

Bytes per token: every non-expert matrix once (attention q/k/v/o, norms, the router, the output head, one
embedding row) plus, for a MoE, expert_used_count experts x (gate, up, down) per layer. The ceiling: numba
parallel reductions (nothing to compute) over the model's own mapping (its page cache, no copy), read in
pieces the size of one layer's expert reads or of the whole step, best and median of repeated passes; and the
same reductions over the step's actual tensor ranges (8 random experts per layer, attention, router, head), in
decode order: one parallel region per tensor, or one region for the whole step (each thread reads its share of
every range in turn: no launch, join or idle thread between tensors). Two readers: a plain sum of 64-bit words
(auto-vectorised, no software prefetch: what the hardware prefetchers alone give a sequential read) and a xor
of 64-byte lines with a software prefetch --pf bytes ahead (as the row dots prefetch). Until the eleventh
session the plain reader was a scalar xor loop, compute-bound at ~5 GB/s a thread: its rows then measured the
loop, not the memory.
--tok-s NAME=X (repeatable) prints X's effective read rate (bytes per token x X) and its share of the ceiling.
--decode ROUNDS: this machine's 2-thread bandwidth swings (30 to 50 GB/s within a minute on the KVM guest of
the tenth and eleventh sessions), so a ceiling measured apart says little about a decode measured later. This
opens the model resident, in this process, and alternates rounds of stream-run's decode (--tg steps after a
--pp-token prompt; median step) with rounds of the one-region read of the same number of steps' ranges
(median), and prints the decode step as a share of the read.
--read-only STEPS: only the one-region read of STEPS random steps' ranges (after one warm pass), printed as one
JSON line {"bytes_per_token", "read_gb_s" (median step), "read_gb_s_best"}: bench/decode_vs_llama.py --read runs
it right after every decode it times, to pair each engine's decode with the machine's bandwidth of that moment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from streamer.gguf_file import GGUFFile
from streamer.kernels.simd import I64, V, _Emit


@intrinsic
def _xor_lines(typingctx, w, start, n_lines, pf):
    """xor of n_lines 64-byte lines of w (uint8) from byte start, one <8 x i64> load per line, with a software
    prefetch pf bytes ahead (as the row dots prefetch): the read with nothing to compute."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        w_, start_, n_, pf_ = args
        wb = e.base(sig.args[0], w_)
        vt = V(I64, 8)

        def step(i, acc):
            at = builder.add(start_, builder.mul(i, ir.Constant(I64, 64)))
            e.prefetch(wb, builder.add(at, pf_))
            return [builder.xor(acc[0], e.load(wb, at, vt, 64))]

        acc = e.loop(n_, [ir.Constant(vt, [0] * 8)], step)[0]
        res = builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))
        for k in range(1, 8):
            res = builder.xor(res, builder.extract_element(acc, ir.Constant(ir.IntType(32), k)))
        return res

    return types.uint64(w, types.int64, types.int64, types.int64), codegen


@njit(cache=True, nogil=True, inline="always")
def _piece(n, t, nth):
    """[a, b): thread t's piece of n units split into nth contiguous pieces (as a matvec splits rows)."""
    part = (n + nth - 1) // nth
    a = t * part
    return a, min(n, a + part)


@njit(parallel=True, cache=True, nogil=True)
def _xor_ranges_pf(w, starts, sizes, nth, pf):
    """xor of each range's 64-byte lines with vector loads and software prefetch (starts 64-aligned, sizes
    multiples of 64), one parallel region per range, split as _piece splits it."""
    acc = np.uint64(0)
    for i in range(starts.size):
        n = sizes[i] >> 6
        part_x = np.zeros(nth, np.uint64)
        for t in prange(nth):
            a, b = _piece(n, t, nth)
            if b > a:
                part_x[t] = _xor_lines(w, starts[i] + 64 * a, b - a, pf)
        for t in range(nth):
            acc ^= part_x[t]
    return acc


@njit(cache=True, nogil=True)
def _sum(a):
    """Sum of the int64 words of a contiguous slice: LLVM vectorises it (64-byte loads, several accumulators)."""
    s = 0
    for j in range(a.size):
        s += a[j]
    return s


@njit(cache=True, nogil=True, inline="always")
def _sum_piece(w, start, size, t, nth):
    """_sum of thread t's piece (_piece) of the 64-bit words of bytes start .. start + size (8-aligned)."""
    a, b = _piece(size >> 3, t, nth)
    s0 = start >> 3
    return _sum(w[s0 + a : s0 + b]) if b > a else 0


@njit(parallel=True, cache=True, nogil=True)
def _sum_ranges(w, starts, sizes, nth):
    """Plain sum of the 64-bit words of each range, one parallel region per range (_sum_piece per thread)."""
    acc = 0
    for i in range(starts.size):
        part_x = np.zeros(nth, np.int64)
        for t in prange(nth):
            part_x[t] = _sum_piece(w, starts[i], sizes[i], t, nth)
        acc += part_x.sum()
    return acc


@njit(parallel=True, cache=True, nogil=True)
def _sum_step(w, starts, sizes, nth):
    """_sum_ranges in ONE parallel region: thread t reads its piece of every range, the ranges in order."""
    part_x = np.zeros(nth, np.int64)
    for t in prange(nth):
        x = 0
        for i in range(starts.size):
            x += _sum_piece(w, starts[i], sizes[i], t, nth)
        part_x[t] = x
    return part_x.sum()


def step_ranges(g: GGUFFile, rng: np.random.Generator):
    """(start, nbytes) of each tensor range one decode step reads, in decode order; and the byte split by kind."""
    n_layer = int(g.scalar(f"{g.arch}.block_count", int))
    k = int(g.scalar(f"{g.arch}.expert_used_count", int, 0) or 0)
    t = g.tensors
    out: list[tuple[int, int]] = []
    kinds: dict[str, int] = {}

    def add(kind, start, n):
        out.append((start, n))
        kinds[kind] = kinds.get(kind, 0) + n

    emb = t["token_embd.weight"]
    add("embedding row", emb.offset, emb.nbytes // emb.shape[0])
    for layer in range(n_layer):
        pre = f"blk.{layer}."
        for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output"):
            ti = t.get(pre + name + ".weight")
            if ti is not None:
                add("attention", ti.offset, ti.nbytes)
        for name in ("ffn_norm", "ffn_gate_inp"):
            ti = t.get(pre + name + ".weight")
            if ti is not None:
                add("router + ffn norm", ti.offset, ti.nbytes)
        if pre + "ffn_gate_exps.weight" in t:
            n_exp = t[pre + "ffn_gate_exps.weight"].shape[0]
            ids = np.sort(rng.choice(n_exp, k, replace=False))
            for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                ti = t[pre + name + ".weight"]
                per = ti.nbytes // n_exp
                for e in ids:
                    add("experts", ti.offset + int(e) * per, per)
        else:
            for name in ("ffn_gate", "ffn_up", "ffn_down"):
                ti = t[pre + name + ".weight"]
                add("dense ffn", ti.offset, ti.nbytes)
    for name in ("output_norm.weight", "output.weight"):
        ti = t.get(name)
        if ti is not None:
            add("head", ti.offset, ti.nbytes)
    if "output.weight" not in t:  # tied head: the embedding matrix
        add("head", emb.offset, emb.nbytes)
    return out, kinds


def _aligned(ranges, a=64):
    starts = np.array([s // a * a for s, _ in ranges], np.int64)
    sizes = np.array([(s + n + a - 1) // a * a - s // a * a for s, n in ranges], np.int64)
    return starts, sizes


def timeit(fn, reps: int) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pf", type=int, default=8192, help="software prefetch distance (bytes) of the pf variant")
    ap.add_argument("--tok-s", action="append", default=[], help="NAME=tok/s measured elsewhere")
    ap.add_argument(
        "--decode", type=int, default=0, metavar="ROUNDS", help="alternate stream-run's decode with the read"
    )
    ap.add_argument("--pp", type=int, default=128, help="--decode: prompt tokens before the timed steps")
    ap.add_argument("--tg", type=int, default=32, help="--decode: timed decode steps per round")
    ap.add_argument("--read-only", type=int, default=0, metavar="STEPS", help="only the step read, as JSON")
    args = ap.parse_args()
    g = GGUFFile(args.model)
    w = g.mm[: g.mm.size // 8 * 8].view(np.int64)
    ranges, kinds = step_ranges(g, np.random.default_rng(args.seed))
    per_tok = sum(kinds.values())
    if args.read_only:
        read_only(args, g, w, per_tok, numba.config.NUMBA_NUM_THREADS)
        return
    print(f"{args.model}: {per_tok / 1e6:.1f} MB of weights per decode step ({len(ranges)} ranges)")
    for kind, n in kinds.items():
        print(f"  {kind:18s} {n / 1e6:9.1f} MB  {100 * n / per_tok:5.1f}%")

    nthreads = numba.config.NUMBA_NUM_THREADS
    results = {}
    # One contiguous span the size of the step, from the middle of the file (expert bytes), in pieces.
    span0 = g.mm.size // 2 // 4096 * 4096
    for piece_mb in (per_tok / 1e6, 21.0, 2.6):
        piece = int(piece_mb * 1e6) // 64 * 64
        n_pieces = max(1, per_tok // piece)
        starts = span0 + np.arange(n_pieces, dtype=np.int64) * piece
        sizes = np.full(n_pieces, piece, np.int64)
        for nth in sorted({1, nthreads}):
            numba.set_num_threads(nth)
            nb = piece * n_pieces
            best, med = timeit(partial(_sum_ranges, w, starts, sizes, nth), args.reps)
            results[(f"contiguous, {piece_mb:.1f} MB regions", nth)] = (nb / best / 1e9, nb / med / 1e9)
            best, med = timeit(partial(_xor_ranges_pf, g.mm, starts, sizes, nth, args.pf), args.reps)
            results[(f"contiguous, {piece_mb:.1f} MB regions, pf", nth)] = (nb / best / 1e9, nb / med / 1e9)
    starts, sizes = _aligned(ranges)
    for nth in sorted({1, nthreads}):
        numba.set_num_threads(nth)
        best, med = timeit(partial(_sum_ranges, w, starts, sizes, nth), args.reps)
        results[("the step's ranges, one region each", nth)] = (sizes.sum() / best / 1e9, sizes.sum() / med / 1e9)
        best, med = timeit(partial(_sum_step, w, starts, sizes, nth), args.reps)
        results[("the step's ranges, one region in all", nth)] = (sizes.sum() / best / 1e9, sizes.sum() / med / 1e9)
        best, med = timeit(partial(_xor_ranges_pf, g.mm, starts, sizes, nth, args.pf), args.reps)
        results[("the step's ranges, one region each, pf", nth)] = (sizes.sum() / best / 1e9, sizes.sum() / med / 1e9)
    print(
        "\nread ceiling (GB/s best / median; tok/s at that rate; pf: xor of lines + software prefetch, else a plain sum):"
    )
    for (what, nth), (gb_best, gb_med) in results.items():
        print(
            f"  {what:40s} {nth} thr  {gb_best:5.1f} / {gb_med:5.1f} GB/s"
            f"  -> {gb_best * 1e9 / per_tok:5.1f} / {gb_med * 1e9 / per_tok:5.1f} tok/s"
        )
    ceiling = max(v[0] for (_, nth), v in results.items() if nth == nthreads)
    if args.decode:
        decode_beside_read(args, g, w, per_tok, nthreads)
    for spec in args.tok_s:
        name, val = spec.split("=")
        rate = float(val) * per_tok / 1e9
        print(
            f"{name}: {float(val):.2f} tok/s = {rate:.1f} GB/s effective, {100 * rate / ceiling:.0f}% of {ceiling:.1f}"
        )


def random_steps(g: GGUFFile, n: int, seed: int) -> list:
    """The aligned (starts, sizes) ranges of n decode steps, each with its own random experts."""
    rng = np.random.default_rng(seed)
    return [_aligned(step_ranges(g, rng)[0]) for _ in range(n)]


def read_steps(w: np.ndarray, steps: list, nth: int) -> list[float]:
    """Seconds of the one-region read (_sum_step) of each step's ranges, in turn."""
    ts = []
    for starts, sizes in steps:
        t0 = time.perf_counter()
        _sum_step(w, starts, sizes, nth)
        ts.append(time.perf_counter() - t0)
    return ts


def read_only(args, g: GGUFFile, w: np.ndarray, per_tok: int, nth: int) -> None:
    """One JSON line: the one-region read of args.read_only random steps' ranges, median and best per step, after
    a first pass over them all (a fresh process would otherwise time its page faults)."""
    steps = random_steps(g, args.read_only, args.seed + 1)
    read_steps(w, steps, nth)  # a warm pass: the kernel's cache load, and this process's page-table entries
    gb = [per_tok / t / 1e9 for t in read_steps(w, steps, nth)]
    print(
        json.dumps(
            {
                "bytes_per_token": per_tok,
                "read_gb_s": round(statistics.median(gb), 2),
                "read_gb_s_best": round(max(gb), 2),
            }
        )
    )


def decode_beside_read(args, g: GGUFFile, w: np.ndarray, per_tok: int, nth: int) -> None:
    """Alternating rounds in one process: stream-run's resident decode steps, and the one-region read of as many
    steps' ranges (random experts; the same bytes per step as the decode)."""
    from streamer.options import StreamOptions
    from streamer.session import open_model

    s = open_model(g, StreamOptions.build(None, stream=False), n_ctx=args.pp + args.tg + 8, threads=nth)
    s.populate()
    m = s.model
    steps = random_steps(g, args.tg, args.seed + 1)
    prompt = np.arange(1000, 1000 + args.pp)

    def decode() -> float:
        cache = m.new_state()
        m.forward(prompt, cache)
        ts = []
        for _ in range(args.tg):
            t0 = time.perf_counter()
            m.forward(np.array([5]), cache)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def read() -> float:
        return statistics.median(read_steps(w, steps, nth))

    decode(), read()  # compile, warm
    res = {"decode": [], "read": []}
    print(f"\nstream-run's decode beside the read of its bytes ({nth} threads, pp {args.pp}, {args.tg} steps a round):")
    for r in range(args.decode):
        for name, fn in (("decode", decode), ("read", read)) if r % 2 == 0 else (("read", read), ("decode", decode)):
            res[name].append(fn())
        d, rd = res["decode"][-1], res["read"][-1]
        print(
            f"  round {r + 1}: decode step {d * 1e3:6.2f} ms, read {rd * 1e3:6.2f} ms ({per_tok / rd / 1e9:4.1f} GB/s)"
        )
    d, rd = statistics.median(res["decode"]), statistics.median(res["read"])
    share = statistics.median(a / b for a, b in zip(res["read"], res["decode"]))
    print(
        f"medians: decode step {d * 1e3:.2f} ms ({1 / d:.2f} tok/s), read {rd * 1e3:.2f} ms ({per_tok / rd / 1e9:.1f} GB/s);"
        f" the decode runs at {100 * share:.0f}% of the read's speed (median of rounds)"
    )


if __name__ == "__main__":
    main()
