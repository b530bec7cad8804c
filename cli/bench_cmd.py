"""`stream-run bench` (speed, traffic, memory) and `stream-run profile` (per-layer expert traffic table)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.bench import format_bench, run_bench
from streamer.cli.common import (
    check_output_path,
    check_prompt,
    check_trace,
    open_session,
    probe,
    progress_printer,
)
from streamer.cli.options import CtxSize, ModelArg, NPredict, Threads, TraceOut, with_stream_options
from streamer.errors import StreamerError
from streamer.generate import Generator
from streamer.io import atomic_write
from streamer.options import StreamOptions
from streamer.plots import plot_profile, require_matplotlib
from streamer.sampler import Sampler, SamplerParams
from streamer.state import check_room
from streamer.tokenizer import Tokenizer


@with_stream_options(learn_by_default=False)
def bench(
    model: ModelArg,
    pp: Annotated[int, typer.Option("--pp", help="Prompt tokens to prefill.")] = 128,
    tg: Annotated[int, typer.Option("--tg", help="Tokens to decode greedily.")] = 64,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags, --learn and --preset (with_stream_options)
    random_decode: Annotated[
        bool,
        typer.Option(
            "--random-decode",
            help="Feed each decode step a random token "
            "instead of the greedy one: routing never repeats (worst case for "
            "the expert cache).",
        ),
    ] = False,
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            "-np",
            help="Sequences decoded together, each from its own random prompt (their KV caches count in the "
            "budget); reports all of them together and per sequence.",
        ),
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON line.")] = False,
    trace: TraceOut = None,
) -> None:
    """Warm up, prefill --pp tokens, decode --tg tokens greedily; report tok/s, GB/s of weights, disk reads,
    expert hit rate, MiB read per token, prefetch recall and peak RSS."""
    if pp < 1 or tg < 1:
        raise StreamerError("--pp and --tg must be at least 1")
    if parallel < 1:
        raise StreamerError(f"--parallel must be at least 1, got {parallel}")
    if trace is not None and parallel > 1:
        raise StreamerError("--trace records one sequence's routing: drop it or --parallel")
    t0 = time.perf_counter()
    ctx = pp + tg + 1 if ctx_size is None else ctx_size
    gf, cfg = probe(model)
    check_trace(trace, cfg)
    check_room(0, pp + tg - 1, cfg.context(ctx))  # the prefill, then tg - 1 decode steps
    options = dataclasses.replace(options, n_seq=parallel)
    with open_session(gf, options, ctx, threads, trace=trace) as s:
        load_s = time.perf_counter() - t0
        progress = progress_printer("reading weights into RAM", after_s=1.0)
        r = run_bench(s, pp, tg, load_s=load_s, random_decode=random_decode, progress=progress, parallel=parallel)
    print(json.dumps(r) if as_json else format_bench(r))


@with_stream_options
def profile(
    model: ModelArg,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text.")] = "The quick brown fox",
    n_predict: NPredict = 32,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags and --preset (with_stream_options)
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Also write the full profile as JSON.")] = None,
    trace: TraceOut = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            help="Write a PNG: expert usage heatmap (layer x expert) "
            "and per-layer bytes and stall (needs the [plot] extra).",
        ),
    ] = None,
) -> None:
    """Generate greedily and print per-layer expert traffic: hits by tier, misses, bytes, prefetch recall, stall."""
    if plot is not None:
        require_matplotlib()
    check_output_path(json_out, "--json-out")
    check_output_path(trace, "--trace")
    check_output_path(plot, "--plot")
    gf, cfg = probe(model)
    if not cfg.is_moe:
        raise StreamerError(f"{model} is a dense model: it has no experts to profile")
    tok = Tokenizer.from_gguf(gf)
    ids = tok.encode(prompt)
    check_prompt(ids, cfg, ctx_size)
    with open_session(gf, options, ctx_size, threads, tok, trace) as s:
        gen = Generator(s.model, s.model.new_state(), Sampler(SamplerParams(temperature=0.0)), tok.eog_ids)
        for _ in gen.generate(ids, n_predict):
            pass
        report = s.traffic.report()
        report["speed"] = gen.stats.line()
        print(s.traffic.table())
        print(s.traffic.summary())
        print(gen.stats.line(), file=sys.stderr)
        counts = s.moe.usage.counts.copy()
    if plot is not None:
        plot_profile(report, counts, plot, title=f"{model.name}: ")
        print(f"wrote {plot}", file=sys.stderr)
    if json_out is not None:
        atomic_write(json_out, lambda f: f.write(json.dumps(report, indent=1).encode()))
        print(f"wrote {json_out}", file=sys.stderr)
