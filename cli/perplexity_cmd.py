"""`stream-run perplexity`: llama-perplexity's method (streamer/perplexity.py) on any model and budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamer.cli.common import open_session, probe
from streamer.cli.options import ModelArg, Threads, with_stream_options
from streamer.io import read_text
from streamer.options import StreamOptions
from streamer.perplexity import perplexity as run_ppl, plan
from streamer.tokenizer import Tokenizer


@with_stream_options
def perplexity(
    model: ModelArg,
    file: Annotated[Path, typer.Option("-f", "--file", help="UTF-8 text to score.", show_default=False)],
    ctx_size: Annotated[
        int, typer.Option("-c", "--ctx-size", help="Window size in tokens; the second half of each window is scored.")
    ] = 512,
    chunks: Annotated[
        Optional[int], typer.Option("--chunks", help="Score at most this many windows [default: all].")
    ] = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags and --preset (with_stream_options)
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the running estimates and the final line.")
    ] = False,
) -> None:
    """Perplexity of a text, computed like llama.cpp's llama-perplexity: non-overlapping windows of -c tokens,
    the second half of each scored; running [i]ppl estimates as it goes, then PPL +/- its standard error."""
    # everything that can be wrong with the input fails here, before kernels compile or weights are read
    text = read_text(file)
    gf, cfg = probe(model)
    tok = Tokenizer.from_gguf(gf)
    ids = tok.encode(text)  # with BOS first if the model adds it (llama.cpp: common_tokenize(..., true))
    n_chunk = plan(len(ids), ctx_size, chunks)
    cfg.context(ctx_size)
    bos = tok.bos_id if tok.add_bos else None
    print(
        f"perplexity: {len(ids)} tokens; {n_chunk} windows of {ctx_size}, scoring the last "
        f"{ctx_size - 1 - ctx_size // 2} tokens of each",
        file=sys.stderr,
        flush=True,
    )

    def show(i: int, r, seconds: float) -> None:
        if i == 0:
            print(
                f"perplexity: {seconds:.2f} seconds per window - ETA {seconds * n_chunk / 60:.2f} minutes",
                file=sys.stderr,
                flush=True,
            )
        out = sys.stderr if as_json else sys.stdout
        print(f"[{i + 1}]{r.running[-1]:.4f},", end="" if i + 1 < n_chunk else "\n", file=out, flush=True)

    with open_session(gf, options, ctx_size, threads, tok) as s:
        r = run_ppl(s.model, ids, ctx_size, chunks, bos_id=bos, on_chunk=show)
        if as_json:
            print(json.dumps({"model": str(model), "file": str(file), **r.to_dict()}))
        else:
            print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.stderr:.5f}")
        s.report(sys.stderr)
