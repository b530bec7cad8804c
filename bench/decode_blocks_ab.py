#!/usr/bin/env python3
"""A/B of the one-token decode step: kernels/decode.py's one-call blocks (and the MoE layer's decode fast
path) against the per-call path, in alternating rounds in one process (ratios hold on a busy machine).

    python bench/decode_blocks_ab.py /work/models/qwen3-30b-a3b-Q4_K.gguf --no-stream -t 2 --layers 8
    python bench/decode_blocks_ab.py /work/models/qwen3-0.6b-Q4_K.gguf -t 2

Each round: per variant a fresh cache and a prefill of --pp tokens, then --tg greedy steps of each variant in
turn (A, B, A, B, ...), each step timed. Prints each variant's median and best step, and the speed-up as the
median of the paired steps' ratios (robust to other jobs on the machine) and as the ratio of the best steps.
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
    ap.add_argument("-p", "--pp", type=int, default=16)
    ap.add_argument("-n", "--tg", type=int, default=24)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per variant, alternating")
    ap.add_argument("--layers", type=int, default=None, help="run only the first N layers")
    ap.add_argument("--no-stream", action="store_true")
    a = ap.parse_args(argv)

    from streamer.bench import prompt_tokens
    from streamer.options import StreamOptions
    from streamer.pagein import PageIn
    from streamer.session import forward_order, open_model

    s = open_model(a.model, StreamOptions(stream=not a.no_stream, learn=False), n_ctx=a.pp + a.tg + 8,
                   threads=a.threads)  # fmt: skip
    m = s.model
    if a.layers:
        m.layers = m.layers[: a.layers]
    n_layer = len(m.layers)
    keep = [
        (t.offset, t.nbytes)
        for name, t in s.gf.tensors.items()
        if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer
    ]
    if s.pagein is not None:
        s.pagein.stop()
    PageIn(s.gf.mm, forward_order(s.gf, keep)).run()
    if s.moe is not None and not s.streaming and hasattr(s.moe.source, "resident"):
        s.moe.source.resident()
    plan = m._decode
    variants = {"per-call": None, "one-call": plan}
    ids = prompt_tokens(s.cfg.n_vocab, a.pp)

    def steps(rounds: int) -> dict:
        """Both variants decode side by side, one step each in turn (each its own cache and tokens)."""
        out = {k: [] for k in variants}
        for _ in range(rounds):
            st = {}
            for k, v in variants.items():
                m._decode = v
                cache = m.new_state()
                st[k] = [cache, int(np.argmax(m.forward(ids, cache)))]
            for _ in range(a.tg):
                for k, v in variants.items():
                    m._decode = v
                    cache, tok = st[k]
                    t0 = time.perf_counter()
                    logits = m.forward(np.array([tok]), cache)
                    out[k].append(time.perf_counter() - t0)
                    st[k][1] = int(np.argmax(logits))
        m._decode = plan
        out["last"] = {k: st[k][1] for k in variants}
        return out

    steps(1)  # compile / first touch
    res = steps(a.rounds)
    print(f"{a.model}: {n_layer} layers, threads {a.threads or 'default'}, pp {a.pp}, tg {a.tg} x {a.rounds} rounds")
    for k in variants:
        ts = res[k]
        med, best = statistics.median(ts), min(ts)
        print(f"  {k:<9} step ms: median {1e3 * med:.2f} ({1e6 * med / n_layer:.0f} us per layer), "
              f"best {1e3 * best:.2f} ({1e6 * best / n_layer:.0f} us per layer)")  # fmt: skip
    pairs = [b / o for b, o in zip(res["per-call"], res["one-call"])]
    print(
        f"  one-call speed-up: median of step pairs {statistics.median(pairs):.3f}x, of best steps "
        f"{min(res['per-call']) / min(res['one-call']):.3f}x; same last token: {len(set(res['last'].values())) == 1}"
    )
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
