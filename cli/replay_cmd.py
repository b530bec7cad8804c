"""`stream-run replay TRACE`: the expert cache of a recorded run, re-run offline at other budgets and policies."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.cli.common import progress_printer
from streamer.errors import StreamerError
from streamer.io import parse_size
from streamer.plots import plot_replay, require_matplotlib
from streamer.trace import load_trace


def _sizes(text: str) -> tuple:
    return tuple(parse_size(t) for t in text.split(",") if t.strip())


def replay(
    trace: Annotated[Path, typer.Argument(help="A routing trace written by --trace.", show_default=False)],
    budget: Annotated[
        Optional[str],
        typer.Option(
            "--budget", help="RAM budgets to replay at, comma-separated (e.g. 2G,4G,8G) [default: the recorded cache]."
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Eviction policies, comma-separated: lru, lfu, pinned-lru, "
            "belady (offline optimal), per-layer (slot quotas per layer).",
        ),
    ] = "lru,lfu,pinned-lru,belady",
    expert_top_p: Annotated[
        Optional[float], typer.Option("--expert-top-p", help="Replay with this expert top-p [default: the run's].")
    ] = None,
    prefetch: Annotated[
        Optional[bool],
        typer.Option(
            "--prefetch/--no-prefetch",
            help="Replay the recorded lookahead prefetches [default: as the run had it].",
            show_default=False,
        ),
    ] = None,
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="Also print hit rate and MiB/token per layer.")
    ] = False,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            help="Write a PNG: hit rate and MiB read per token "
            "against budget, one line per policy (needs the [plot] extra).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Simulate the expert cache of a recorded run (the runtime's own cache, budget and scheduling code) at
    each budget and policy: hit rate and bytes read per token, overall and per layer, with Belady as the ceiling."""
    from streamer.replay import ReplayOptions, format_replay, replay as run_replay  # numba: the runtime's cache

    if expert_top_p is not None and not 0.0 < expert_top_p <= 1.0:
        raise StreamerError(f"--expert-top-p must be in (0, 1], got {expert_top_p}")
    budgets = (None,) if budget is None else _sizes(budget)
    if not budgets:
        raise StreamerError("--budget needs at least one size")
    policies = tuple(p.strip() for p in policy.split(",") if p.strip())
    if plot is not None:
        require_matplotlib()
    t = load_trace(trace)
    slow = len(budgets) * len(policies) * len(t.a["q_call"]) > 300_000  # about a second per 100k requests
    show = progress_printer("replaying", lambda d, n: f"{d} / {n} runs") if slow else None
    r = run_replay(t, ReplayOptions(budgets, policies, expert_top_p, prefetch), progress=show)
    if plot is not None:
        plot_replay(r, plot)
        print(f"wrote {plot}", file=sys.stderr)
    print(json.dumps(r) if as_json else format_replay(r, per_layer))
