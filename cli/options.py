"""Flags shared by several commands, as Annotated aliases (defaults stay in each command's signature), and
`with_stream_options`: the memory/streaming flags and --preset, declared once, reaching a command as one
validated StreamOptions."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.options import StreamOptions, available_presets

ModelArg = Annotated[
    Path,
    typer.Argument(
        help="GGUF model file (qwen3, qwen3moe or qwen2; a split model: its first shard).", show_default=False
    ),
]
CtxSize = Annotated[
    Optional[int],
    typer.Option(
        "-c",
        "--ctx-size",
        help="Context size in tokens (0 = the model's limit) [default: 4096, or the model's limit if smaller].",
        show_default=False,
    ),
]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", help="Compute threads [default: physical cores].")]
NPredict = Annotated[
    int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until end of text or full context).")
]
Temp = Annotated[Optional[float], typer.Option("--temp", help="Temperature; <= 0 is greedy.")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Top-k sampling (<= 0: off).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Top-p (nucleus) sampling.")]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Min-p sampling.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1.0 = off).")]
RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalties look back over (-1 = all).")]
FreqPenalty = Annotated[float, typer.Option("--frequency-penalty", help="Frequency penalty.")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="Presence penalty.")]
Seed = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1 = random).")]
TraceOut = Annotated[
    Optional[Path],
    typer.Option(
        "--trace",
        help="Record the routing trace (per step and layer: "
        "routed experts and weights, how each request was served, bytes, "
        "stalls, prefetches) to this .npz, for `stream-run replay`.",
    ),
]


def _preset_names() -> str:
    """The built-in preset names, read from streamer.presets (a directory listing: no TOML parsed)."""
    try:
        return ", ".join(available_presets())
    except Exception:  # never let --help fail over a listing
        return "see `stream-run presets`"


# The memory/streaming flags: parameter name (a StreamOptions field, or `preset`) -> (annotation, default).
# None means "not given": the preset's value, else the built-in default.
STREAM_FLAGS = {
    "ram_budget": (
        Annotated[
            Optional[str],
            typer.Option(
                "--ram-budget",
                help="RAM budget for everything resident, e.g. 8G [default: a fraction of available memory].",
            ),
        ],
        None,
    ),
    "stream": (
        Annotated[
            bool,
            typer.Option(" /--no-stream", help="Keep all experts resident (mmap); no streaming.", show_default=False),
        ],
        True,
    ),
    "mmap": (
        Annotated[
            bool,
            typer.Option(
                "--mmap/--no-mmap",
                help="Use the file's pages in place, or read the whole model into memory at load as llama.cpp's "
                "--no-mmap (implies --no-stream; the model must fit the RAM budget) [default: in place].",
                show_default=False,
            ),
        ],
        True,
    ),
    "expert_top_p": (
        Annotated[
            Optional[float],
            typer.Option(
                "--expert-top-p",
                help="Per token, drop routed experts beyond this cumulative weight [default: 1.0 = off].",
            ),
        ],
        None,
    ),
    "expert_skip": (
        Annotated[
            Optional[float],
            typer.Option(
                "--expert-skip",
                help="Per token, skip a routed expert that is neither cached nor being read when its share of "
                "the routing weight is below this (APPROXIMATE outputs; e.g. 0.05) [default: 0 = off].",
            ),
        ],
        None,
    ),
    "prefetch": (
        Annotated[
            Optional[bool],
            typer.Option(
                "--prefetch/--no-prefetch", help="Router-lookahead expert prefetch [default: on].", show_default=False
            ),
        ],
        None,
    ),
    "learn": (
        Annotated[
            bool,
            typer.Option(" /--no-learn", help="Do not load or save the learned expert-usage file.", show_default=False),
        ],
        True,
    ),
    "preset": (
        Annotated[
            Optional[str],
            typer.Option(
                "--preset",
                "--profile",
                help="Runtime preset: a built-in name "
                f"({_preset_names()}; `stream-run presets` describes them) or a "
                ".toml file; flags given explicitly win.",
            ),
        ],
        None,
    ),
    "io": (
        Annotated[
            str,
            typer.Option(
                "--io",
                help="Expert reads: direct (O_DIRECT, bypasses the page cache), "
                "buffered (+ POSIX_FADV_DONTNEED), or auto (direct where the filesystem "
                "allows it).",
            ),
        ],
        "auto",
    ),
}
LEARN_OPT_IN = (
    Annotated[
        bool,
        typer.Option(
            "--learn",
            help="Load and save the learned expert-usage file (off: "
            "benchmarks stay reproducible and leave your file alone).",
        ),
    ],
    False,
)


def with_stream_options(command=None, *, learn_by_default: bool = True):
    """Decorator: the command's `options` parameter becomes the memory/streaming flags and --preset (in its
    place, so --help keeps the order), and the command receives them as one StreamOptions, built (preset
    loaded, values validated) before its body runs. learn_by_default=False: `--learn` opts in instead."""
    if command is None:
        return functools.partial(with_stream_options, learn_by_default=learn_by_default)
    flags = dict(STREAM_FLAGS, **({} if learn_by_default else {"learn": LEARN_OPT_IN}))
    sig = inspect.signature(command, eval_str=True)
    params = []
    for p in sig.parameters.values():
        if p.name != "options":
            params.append(p)
            continue
        params += [
            inspect.Parameter(name, p.kind, annotation=ann, default=default) for name, (ann, default) in flags.items()
        ]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in flags}
        return command(*args, options=StreamOptions.build(given.pop("preset"), **given), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)
    return wrapper
