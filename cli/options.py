"""Flags shared by several commands, as Annotated aliases (defaults stay in each command's signature)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ModelArg = Annotated[Path, typer.Argument(help="GGUF model file (qwen3 or qwen3moe).", show_default=False)]
CtxSize = Annotated[Optional[int], typer.Option("-c", "--ctx-size", help="Context size in tokens (0 = the model's "
                                                "limit) [default: 4096, or the model's limit if smaller].",
                                                show_default=False)]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", help="Compute threads [default: physical cores].")]
NPredict = Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until end of text or full context).")]
Temp = Annotated[Optional[float], typer.Option("--temp", help="Temperature; <= 0 is greedy.")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Top-k sampling (<= 0: off).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Top-p (nucleus) sampling.")]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Min-p sampling.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1.0 = off).")]
RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalties look back over (-1 = all).")]
FreqPenalty = Annotated[float, typer.Option("--frequency-penalty", help="Frequency penalty.")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="Presence penalty.")]
Seed = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1 = random).")]
RamBudget = Annotated[Optional[str], typer.Option("--ram-budget", help="RAM budget for everything resident, e.g. 8G "
                                                  "[default: a fraction of available memory].")]
NoStream = Annotated[bool, typer.Option("--no-stream", help="Keep all experts resident (mmap); no streaming.")]
ExpertTopP = Annotated[Optional[float], typer.Option("--expert-top-p", help="Per token, drop routed experts beyond "
                                                     "this cumulative weight [default: 1.0 = off].")]
Prefetch = Annotated[Optional[bool], typer.Option("--prefetch/--no-prefetch", help="Router-lookahead expert "
                                                  "prefetch [default: on].", show_default=False)]
NoLearn = Annotated[bool, typer.Option("--no-learn", help="Do not load or save the learned expert-usage profile.")]
IoMode = Annotated[str, typer.Option("--io", help="Expert reads: direct (O_DIRECT, bypasses the page cache), buffered "
                                     "(+ POSIX_FADV_DONTNEED), or auto (direct where the filesystem allows it).")]


def _profile_names() -> str:
    """The built-in profile names, read from the profiles/ package (a directory listing: no TOML parsed)."""
    try:
        from streamer.profiles import available
        return ", ".join(available())
    except Exception:  # never let --help fail over a listing
        return "see `stream-run profiles`"


Profile = Annotated[Optional[str], typer.Option("--profile", help=f"Runtime preset: a built-in name ({_profile_names()}; "
                                               "`stream-run profiles` describes them) or a .toml file; flags given "
                                               "explicitly win.")]
