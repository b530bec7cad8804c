"""`stream-run warmup`: compile every numba kernel ahead of time, so no later run pays for it."""

from __future__ import annotations

import sys
import time


def warmup() -> None:
    """Compile every kernel (all weight formats, the ops, the MoE expert kernels) now; numba caches them on
    disk, so later runs and a second warmup only load them. After an in-place edit of the kernel sources, it
    drops their stale cached machine code first."""
    t0 = time.perf_counter()
    print("loading numba...", file=sys.stderr, flush=True)
    from streamer import warmup as kw
    from streamer.kernels._cache import drop_stale_numba_cache

    drop_stale_numba_cache()  # kernel sources edited in place: their old machine code goes, before any loads

    def before(g) -> None:
        print(f"{g.name:>8}: {len(g.kernels)} kernels ...", end="", file=sys.stderr, flush=True)

    def after(r) -> None:
        how = (
            "from cache"
            if r.compiled == 0
            else "compiled"
            if r.compiled >= r.n_kernels
            else f"compiled {r.compiled}, {r.n_kernels - r.compiled} from cache"
        )
        print(f" {how} in {r.seconds:.1f} s", file=sys.stderr, flush=True)

    reports = kw.warmup(before, after)
    n, compiled = sum(r.n_kernels for r in reports), sum(min(r.compiled, r.n_kernels) for r in reports)
    print(
        f"warmup: {n} kernels ready ({compiled} compiled, {n - compiled} from cache) in "
        f"{time.perf_counter() - t0:.1f} s; numba cache: {kw.cache_dir()}"
    )
