#!/usr/bin/env python3
"""Decode with the model's file mapped 2 MiB-aligned (the page cache's 2 MiB folios mapped whole) against
page-aligned (every folio by 4 KiB entries), paired steps in one process.

    python bench/mapping_ab.py /work/models/qwen3-30b-a3b-Q4_K.gguf --steps 80

The same file is opened twice, once with streamer.mapping.ALIGN = 2 MiB (as stream-run maps it) and once with
ALIGN = one page (as it did before); both share the page cache. Each round decodes one random token at the same
positions with both, in alternating order, and the ratio of each pair's step times is taken (robust to the
machine's drift). How much of the file is in 2 MiB folios decides what alignment can gain: read it whole first
(stream-run's page-in of a resident model does, in huge mode; `cat` does too). Prints FilePmdMapped, each
mapping's median and best step, and the median paired ratio. Resident (--no-stream), all experts in RAM.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)

    import time

    from streamer import mapping
    from streamer.options import StreamOptions
    from streamer.session import open_model

    def opened(align: int):
        mapping.ALIGN = align
        s = open_model(a.model, StreamOptions.build(None, stream=False), n_ctx=a.pp + 64, threads=a.threads)
        s.populate()
        cache = s.model.new_state()
        s.model.forward(np.arange(1000, 1000 + a.pp), cache)
        return s, cache, []

    huge, page = opened(2 * 2**20), opened(mapping.PAGE)
    with open("/proc/self/smaps_rollup") as f:
        print(next(line.strip() for line in f if line.startswith("FilePmdMapped")))
    rng = np.random.default_rng(1)
    pos = huge[1].n
    for r in range(a.steps):
        tok = np.array([int(rng.integers(1000, 100000))])
        for s, cache, times in (huge, page) if r % 2 == 0 else (page, huge):
            cache.n = pos + r % 32
            t = time.perf_counter()
            s.model.forward(tok, cache)
            times.append(time.perf_counter() - t)
    th, tp = np.array(huge[2]) * 1e3, np.array(page[2]) * 1e3
    print(f"2 MiB-aligned  median {np.median(th):.2f} ms  best {th.min():.2f}")
    print(f"page-aligned   median {np.median(tp):.2f} ms  best {tp.min():.2f}")
    print(f"paired ratio page-aligned / 2 MiB-aligned: median {np.median(tp / th):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
