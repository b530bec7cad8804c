"""`stream-run warmup`: compile numba kernels ahead of time, so no later run pays for it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.cli.demo_cmd import demo_model, demo_options
from streamer.options import StreamOptions
from streamer.session import open_model


def warmup(
    models: Annotated[
        Optional[list[Path]],
        typer.Argument(
            help="GGUF files whose kernels to compile [default: the demo's, and llama-quantize's Q4_K_M, Q5_K_M, "
            "Q6_K and Q8_0 mixes'].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Compile the kernels a run needs now (each weight format's are compiled apart); numba caches them on disk, so
    later runs and a second warmup only load them. Without MODELS: the packaged demo's kernels and those of the
    common llama-quantize mixes (Q4_K_M, Q5_K_M, Q6_K, Q8_0); any other file's compile at its first run. After an
    in-place edit of the kernel sources, it drops their stale cached machine code first."""
    t0 = time.perf_counter()
    print("loading numba...", file=sys.stderr, flush=True)
    from streamer import warmup as kw  # numba, and every kernel module: after the line above is shown
    from streamer.kernels._cache import drop_stale_numba_cache

    drop_stale_numba_cache()  # kernel sources edited in place: their old machine code goes, before any loads

    def how(compiled: int, n: int) -> str:
        return (
            "from cache" if compiled == 0 else "compiled" if compiled >= n else f"compiled {compiled}, rest from cache"
        )

    def before(g) -> None:
        print(f"{g.name:>8}: ...", end="", file=sys.stderr, flush=True)

    def after(r) -> None:  # kernels: compiled versions (one per format tuple of a per-format kernel)
        print(
            f" {r.n_kernels} kernels, {how(r.compiled, r.n_kernels)} in {r.seconds:.1f} s", file=sys.stderr, flush=True
        )

    n = compiled = 0
    if models:
        for path in models:
            k, c = _model(kw, path)
            n, compiled = n + k, compiled + c
    else:
        k, c = _model(kw, demo_model(), demo_options())
        qtypes, combos = kw.recipe_formats()
        reports = kw.warmup(before, after, only=kw.common_groups(qtypes), qtypes=qtypes, decode_combos=combos)
        n = k + sum(r.n_kernels for r in reports)
        compiled = c + sum(min(r.compiled, r.n_kernels) for r in reports)
    print(
        f"warmup: {n} kernels ready ({compiled} compiled, {n - compiled} from cache) in "
        f"{time.perf_counter() - t0:.1f} s; numba cache: {kw.cache_dir()}"
    )


def _model(kw, path: Path, options=None) -> tuple[int, int]:
    """Open the model as a run does (which compiles, or loads, the kernels its run calls) and close it: (kernels,
    compiled)."""
    t0, c0 = time.perf_counter(), kw.compiles()
    with open_model(path, options or StreamOptions(learn=False), lazy_kernels=False) as s:
        n = len(s.kernels)  # the dispatchers its run calls (model_kernels: one per format tuple)
    compiled = min(kw.compiles() - c0, n)
    how = "from cache" if compiled == 0 else f"compiled {compiled}"
    print(f"{path.name}: {n} kernels, {how} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return n, compiled
