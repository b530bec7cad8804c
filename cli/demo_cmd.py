"""`stream-run demo`: the whole product on the small Qwen3-MoE that ships with the package (trained here on the
CPython standard library, streamer/train): it generates code with the experts streamed from disk into a cache
that holds only a quarter of them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

import streamer
from streamer.cli.options import Threads
from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.generate import Generator
from streamer.gguf_file import GGUFFile
from streamer.io import human
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.session import open_model

DEMO_PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'
DEMO_REPEAT_PENALTY = 1.15


def demo_model() -> Path:
    return Path(streamer.__file__).parent / "models" / "stdlib-qwen3moe-q8_0.gguf"


def demo(
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text (Python code works best).")] = DEMO_PROMPT,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate.")] = 64,
    cache_share: Annotated[
        float, typer.Option("--cache-share", help="Share of all experts the cache may hold.")
    ] = 0.25,
    threads: Threads = None,
) -> None:
    """Generate code from the packaged Qwen3-MoE (trained on the Python standard library) with its experts
    streamed into a cache holding a quarter of them, and print the expert traffic."""
    if not 0.0 < cache_share <= 1.0:
        raise StreamerError(f"--cache-share must be in (0, 1], got {cache_share}")
    path = demo_model()
    if not path.is_file():
        raise StreamerError(
            f"the packaged demo model is missing: {path} (regenerate it with "
            "`python -m streamer.train all`, see streamer/train/__init__.py)"
        )
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    n_slots = _slots(cfg, cache_share)
    cache_bytes = n_slots * layout.slot_bytes
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    print(
        f"model {path.name} ({human(gf.size)}): a small Qwen3-MoE ({cfg.n_layer} layers, {cfg.n_expert} experts, "
        f"{cfg.n_expert_used} used per token) trained on the Python standard library's source; expect "
        "Python-looking code, not good code\n"
        f"  in RAM: non-expert weights {human(nonexpert)} (used in place) + expert cache {human(cache_bytes)} "
        f"({n_slots} slots, {100 * n_slots / (cfg.n_layer * cfg.n_expert):.0f}% of the experts, "
        f"{human(layout.total_bytes)} in all) = "
        f"{human(nonexpert + cache_bytes)}, {100 * (nonexpert + cache_bytes) / gf.size:.0f}% of the file; "
        "the other experts are read from disk as tokens need them",
        file=sys.stderr,
    )
    # one compute thread unless asked: this 15 MB model gains nothing from more, and on a busy machine two
    # threads waiting on each other made the demo 10x slower (measured: 24 s with 2, 1.7 s with 1)
    with open_model(path, StreamOptions(expert_cache_bytes=cache_bytes), threads=threads or 1) as s:
        _generate(s, prompt, n_predict)


def _slots(cfg, cache_share: float) -> int:
    # a share of the experts in cache slots (4 KiB-aligned, so larger than an expert), as bench/trained_routing.py
    # counts it: a share of the bytes held 90 of the 128 slots a quarter means, and LRU then never hit
    return max(round(cache_share * cfg.n_layer * cfg.n_expert), cfg.n_expert_used)


def demo_options(cache_share: float = 0.25):
    """The demo's StreamOptions (an expert cache of that share), without the usage file (`stream-run warmup`
    opens the demo model with them: the kernels its run calls)."""
    gf = GGUFFile(demo_model())
    cfg = ModelConfig.from_gguf(gf)
    return StreamOptions(learn=False, expert_cache_bytes=_slots(cfg, cache_share) * ExpertLayout(gf, cfg).slot_bytes)


def _generate(s, prompt: str, n_predict: int) -> None:
    tok = s.tokenizer
    # greedy, with llama.cpp's repeat penalty: a model this small loops on plain greedy decoding
    params = SamplerParams(temperature=0.0, repeat_penalty=DEMO_REPEAT_PENALTY)
    gen = Generator(s.model, s.model.new_state(), Sampler(params), tok.eog_ids)
    ids = tok.encode(prompt)
    dec = tok.stream_decoder()
    print(f"prefill: {len(ids)} tokens ...", end="", file=sys.stderr, flush=True)
    out: list[int] = []
    for t in gen.generate(ids, n_predict):
        if not out:
            print(
                f" done in {gen.stats.prompt_s:.2f} s; generating {n_predict} tokens greedily (repeat penalty "
                f"{DEMO_REPEAT_PENALTY})",
                file=sys.stderr,
                flush=True,
            )
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
    print(s.traffic.table())
    print(s.traffic.summary())
    print(gen.stats.line())
