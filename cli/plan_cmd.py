"""`stream-run plan MODEL`: predicted decode speed and time to first token at each RAM budget, and the budget
to use, from a short disk probe, a timed decode step and a hit-rate model (a trace's replay, or uniform)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.cli.common import progress_printer
from streamer.cli.options import CtxSize, ModelArg, Threads
from streamer.cli.replay_cmd import _sizes
from streamer.errors import StreamerError
from streamer.plots import plot_plan, require_matplotlib


def plan(
    model: ModelArg,
    ram_budget: Annotated[
        Optional[str],
        typer.Option(
            "--ram-budget",
            help="Budgets to predict, comma-separated "
            "(e.g. 6G,8G,12G) [default: a ladder up to this machine's "
            "memory].",
        ),
    ] = None,
    trace: Annotated[
        Optional[Path],
        typer.Option(
            "--trace",
            help="A routing trace of this model (from --trace): "
            "hit rates from its replay instead of the uniform-routing "
            "bound.",
        ),
    ] = None,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Prompt length for the time to first token.")
    ] = 16,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Length of the disk probe.")] = 3.0,
    reprobe: Annotated[
        bool, typer.Option("--reprobe", help="Probe the disk again instead of using the cached figures for its device.")
    ] = False,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot", help="Write a PNG: predicted tok/s and hit rate against budget (needs the [plot] extra)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Will this MoE model run here, and how fast? Predicted decode tok/s and time to first token per budget,
    and a recommended --ram-budget."""
    budgets = None
    if ram_budget is not None:
        budgets = tuple(sorted(set(_sizes(ram_budget))))
        if not budgets:
            raise StreamerError("--ram-budget needs at least one size")
    if prompt_tokens < 1:
        raise StreamerError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if not 0.1 <= probe_seconds <= 60:
        raise StreamerError(f"--probe-seconds must be in [0.1, 60], got {probe_seconds}")
    if plot is not None:
        require_matplotlib()

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    from streamer.plan import PlanOptions, format_plan, make_plan_report  # numba: after the input is checked

    opts = PlanOptions(budgets, trace, ctx_size, prompt_tokens, probe_seconds, reprobe, threads=threads)
    r = make_plan_report(
        model, opts, progress=progress_printer("disk probe", lambda d, n: f"phase {d} of {n}"), say=say
    )
    if plot is not None:
        plot_plan(r, plot)
        print(f"wrote {plot}", file=sys.stderr)
    print(json.dumps(r) if as_json else format_plan(r))
