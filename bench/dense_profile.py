#!/usr/bin/env python3
"""Where a dense prefill goes: time per kernel call of one forward over --pp tokens (QMatrix.matmul per kind
of matrix, the small ops, the head), and the share of the integer kernel's activation quantization
(int8.quantize_act timed alone on the same shapes). Best of --rounds.

    python bench/dense_profile.py /work/models/qwen3-0.6b-Q4_K.gguf -t 2 -p 128
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--pp", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)

    from streamer.bench import prompt_tokens
    from streamer.kernels import dispatch, int8, ops
    from streamer.options import StreamOptions
    from streamer.session import open_model

    s = open_model(a.model, StreamOptions(stream=False, learn=False), n_ctx=a.pp + 8, threads=a.threads)
    m = s.model
    ids = prompt_tokens(s.cfg.n_vocab, a.pp)
    acc, calls, on = defaultdict(float), defaultdict(int), [False]

    def wrap(fn, key):
        @functools.wraps(fn)
        def w(*args, **kw):
            if not on[0]:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            r = fn(*args, **kw)
            k = key(*args)
            acc[k] += time.perf_counter() - t0
            calls[k] += 1
            return r

        return w

    def mat_key(self, *_):
        n = self.name.split(".")
        return "matmul " + (n[2] if n[0] == "blk" else n[0]) + f" {self.qtype.name} {self.n_out}x{self.n_in}"

    Q = dispatch.QMatrix
    Q.matmul = wrap(Q.matmul, mat_key)
    Q.matvec = wrap(Q.matvec, lambda self, *_: "matvec " + self.name.split(".")[-2])
    Q.rows = wrap(Q.rows, lambda *_: "embedding rows")
    for name in ("rmsnorm", "head_norm_rope", "head_rope", "attention", "swiglu"):
        setattr(ops, name, wrap(getattr(ops, name), functools.partial(lambda n, *_: n, name)))
    m._head = wrap(m._head, lambda *_: "head (incl. its matvec)")
    m.forward(ids, m.new_state())
    best, walls = None, []
    for _ in range(a.rounds):
        acc.clear()
        calls.clear()
        on[0] = True
        t0 = time.perf_counter()
        m.forward(ids, m.new_state())
        wall = time.perf_counter() - t0
        on[0] = False
        walls.append(wall)
        if best is None or wall < best[0]:
            best = (wall, dict(acc), dict(calls))
    on[0] = False
    t_plain = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        m.forward(ids, m.new_state())
        t_plain.append(time.perf_counter() - t0)
    wall, tacc, tcalls = best
    print(f"{a.model}: prefill {a.pp} tokens, plain best {min(t_plain) * 1e3:.1f} ms "
          f"({a.pp / min(t_plain):.0f} tok/s), instrumented best {wall * 1e3:.1f} ms")  # fmt: skip
    for k in sorted(tacc, key=lambda k: -tacc[k]):
        print(f"  {k:<40} {tcalls[k]:4d} calls {1e3 * tacc[k]:8.2f} ms {100 * tacc[k] / wall:5.1f}%")
    rest = wall - sum(v for k, v in tacc.items() if k != "head (incl. its matvec)")
    print(f"  {'python and the rest':<40}            {1e3 * rest:8.2f} ms {100 * rest / wall:5.1f}%")
    # the activation quantization inside every integer matmul, alone
    cfg = s.cfg
    for K, _ in ((cfg.n_embd, 0), (cfg.n_head * cfg.head_dim, 0), (m.ffn.w[0][2].n_in, 0)):
        X = np.random.default_rng(0).standard_normal((a.pp, K)).astype(np.float32)
        g = 32
        xq = np.empty((a.pp, 2 * K), np.int8)
        dx, xs, xc = (np.empty((a.pp, K // g), t) for t in (np.float32, np.float32, np.int32))
        int8.quantize_act(X, g, 0, 2, xq, dx, xs, xc)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            int8.quantize_act(X, g, 0, 2, xq, dx, xs, xc)
            ts.append(time.perf_counter() - t0)
        print(f"  quantize_act {a.pp}x{K} alone: {1e6 * min(ts):.0f} us per call")
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
