#!/usr/bin/env python
"""Decode speed with the int8-digit row dots (vpdpbusd, kernels/simd_vnni.py) against the int16 ones, in one process.

    python bench/decode_ab.py /work/models/qwen3-0.6b-Q4_K.gguf --rounds 5
    python bench/decode_ab.py /work/models/qwen3-30b-a3b-Q4_K.gguf --no-stream --pp 32 --tg 32 --rounds 3

The model is opened twice over the same mapping, once per decode path (blocks.DIGITS decides the activation
buffers a model's matrices and expert kernels get when it is opened); rounds alternate between the two: a
--pp prefill, then --tg greedy decode steps. Prints per round and as medians the decode step's wall time
(tok/s) and the process CPU time per step (which other processes on a busy machine disturb less, with -t 1),
and the ratio. Both paths greedy-decode the same tokens as a rule (their logits differ by the activation
rounding only; the count of differing tokens is printed). Needs AVX512-VNNI; the file should be in the page
cache (a MoE resident: --no-stream).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-stream", action="store_true", help="MoE: keep every expert in place (mmap)")
    a = ap.parse_args(argv)

    from streamer.bench import prompt_tokens
    from streamer.kernels import blocks, int8
    from streamer.options import StreamOptions
    from streamer.session import open_model

    if "vnni" not in int8.usable_isas() or int8.ISA != "vnni":
        print("error: needs AVX512-VNNI (and STREAM_RUN_ISA unset): only the int16 decode path runs", file=sys.stderr)
        return 2
    opts = StreamOptions(stream=not a.no_stream, learn=False)
    sessions = {}
    for name, digits in (("int16", False), ("digits", True)):
        blocks.DIGITS = digits
        sessions[name] = open_model(a.model, opts, n_ctx=a.pp + a.tg + 8, threads=a.threads)
    s0 = sessions["int16"]
    ids = prompt_tokens(s0.cfg.n_vocab, a.pp)

    def run(name):
        blocks.DIGITS = name == "digits"  # the MoE prefill's per-call buffers follow it too
        m = sessions[name].model
        cache = m.new_state()
        logits = m.forward(ids, cache)
        tok, toks = int(np.argmax(logits)), []
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.tg):
            logits = m.forward(np.array([tok]), cache)
            tok = int(np.argmax(logits))
            toks.append(tok)
        return (time.perf_counter() - w0) / a.tg, (time.process_time() - c0) / a.tg, toks

    for name in sessions:
        run(name)  # compile / first touch
    res = {name: [] for name in sessions}
    for r in range(a.rounds):
        for name in list(sessions) if r % 2 == 0 else list(sessions)[::-1]:
            wall, cpu, toks = run(name)
            res[name].append((wall, cpu, toks))
            print(f"round {r} {name:6}: {1 / wall:7.2f} tok/s, {1e3 * wall:7.2f} ms/step, cpu {1e3 * cpu:7.2f} ms/step")
    med = {n: (statistics.median(w for w, _, _ in v), statistics.median(c for _, c, _ in v)) for n, v in res.items()}
    diff = sum(x != y for x, y in zip(res["int16"][0][2], res["digits"][0][2]))
    print(
        f"\n{a.model}, threads {a.threads or 'default'}, pp {a.pp}, tg {a.tg}, medians of {a.rounds} rounds:\n"
        f"  int16  {1 / med['int16'][0]:.2f} tok/s (cpu {1e3 * med['int16'][1]:.2f} ms/step)\n"
        f"  digits {1 / med['digits'][0]:.2f} tok/s (cpu {1e3 * med['digits'][1]:.2f} ms/step)\n"
        f"  digits / int16: {med['int16'][0] / med['digits'][0]:.3f}x wall, "
        f"{med['int16'][1] / med['digits'][1]:.3f}x cpu; greedy tokens differing: {diff} of {a.tg}"
    )
    for s in sessions.values():
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
