"""`stream-run run` (raw completion, or logits for given tokens) and `stream-run chat` (multi-turn REPL)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from streamer import timing
from streamer.chat import Conversation, sampler_params, thinks
from streamer.cli.common import (
    check_output_path,
    check_prompt,
    check_trace,
    open_session,
    parse_tokens,
    prefill_progress,
    probe,
)
from streamer.cli.options import (
    CtxSize,
    FreqPenalty,
    MinP,
    ModelArg,
    NPredict,
    PresencePenalty,
    RepeatLastN,
    RepeatPenalty,
    Seed,
    Temp,
    Threads,
    TopK,
    TopP,
    TraceOut,
    with_stream_options,
)
from streamer.errors import ModelFileChanged, StreamerError
from streamer.generate import Generator
from streamer.io import atomic_save_npy, read_text
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.tokenizer import Tokenizer


@with_stream_options
def run(
    model: ModelArg,
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="Prompt text.")] = None,
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="Read the prompt from a UTF-8 file.")] = None,
    tokens: Annotated[Optional[str], typer.Option("--tokens", help="Prompt as token ids, e.g. 1,2,3.")] = None,
    logits_out: Annotated[
        Optional[Path],
        typer.Option(
            "--logits-out",
            help="With --tokens: write float32 logits (n_tokens, vocab) of every prompt position to this .npy.",
        ),
    ] = None,
    n_predict: NPredict = -1,
    temp: Temp = 0.0,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    frequency_penalty: FreqPenalty = 0.0,
    presence_penalty: PresencePenalty = 0.0,
    seed: Seed = -1,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags and --preset (with_stream_options)
    trace: TraceOut = None,
    display_prompt: Annotated[
        bool, typer.Option("--display-prompt/--no-display-prompt", help="Echo the prompt before the completion.")
    ] = True,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos", help="Do not stop at end-of-generation tokens (generate -n tokens or to a full context)."
        ),
    ] = False,
) -> None:
    """Complete a prompt (greedy by default), streaming the text; end with a speed summary on stderr.
    Ctrl-C stops the run (exit code 130) after printing what was generated."""
    timing.mark("cli")
    if sum(x is not None for x in (prompt, file, tokens)) != 1:
        raise StreamerError("give exactly one of -p/--prompt, -f/--file or --tokens")
    if logits_out is not None and tokens is None:
        raise StreamerError("--logits-out needs --tokens")
    check_output_path(logits_out, "--logits-out")
    sampler = Sampler(
        SamplerParams(
            temp,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            frequency_penalty,
            presence_penalty,
            None if seed < 0 else seed,
        )
    )
    gf, cfg = probe(model)
    check_trace(trace, cfg)
    tok = None if tokens is not None else Tokenizer.from_gguf(gf)
    ids = parse_tokens(tokens) if tok is None else tok.encode(read_text(file) if file is not None else prompt)
    check_prompt(ids, cfg, ctx_size)
    timing.mark("input_checked")
    with open_session(gf, options, ctx_size, threads, tok, trace, lazy_kernels=True) as s:
        if logits_out is not None:
            _write_logits(s, ids, logits_out)
        else:
            _complete(s, ids, sampler, n_predict, display_prompt, ignore_eos)


def _write_logits(s, ids: list[int], path: Path) -> None:

    logits = s.model.forward(np.asarray(ids, np.int64), s.model.new_state(), all_logits=True)
    atomic_save_npy(path, logits.astype(np.float32))
    print(f"wrote logits {logits.shape} to {path}", file=sys.stderr)


def _complete(s, ids, sampler, n_predict, display_prompt, ignore_eos) -> None:
    s.tokenizer_in_background()  # a prompt of token ids: the tokenizer builds while the prompt runs
    if sampler.params.temperature > 0:
        print(f"sampling with seed {sampler.seed}", file=sys.stderr)
    gen = Generator(
        s.model,
        s.model.new_state(),
        sampler,
        on_prefill=prefill_progress(),
        stop_ids_after_prompt=(lambda: frozenset()) if ignore_eos else (lambda: s.tokenizer.eog_ids),
    )
    out = sys.stdout
    if display_prompt:
        out.write(s.tokenizer.decode(ids))
        out.flush()
    dec = None
    timing.mark("forward_start")
    try:
        for i, t in enumerate(gen.generate(ids, n_predict)):
            if i == 0:
                s.mark_first_token()
                dec = s.tokenizer.stream_decoder()
            piece = dec.push(t)
            if piece:
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:
        gen.stop_reason = "interrupted"
    out.write((dec.flush() if dec is not None else "") + "\n")
    out.flush()
    print(gen.stats.line() + f" | stop: {gen.stop_reason}", file=sys.stderr)
    s.report(sys.stderr)
    if gen.stop_reason == "interrupted":
        raise typer.Exit(130)  # the shell's convention for a run stopped by SIGINT


@with_stream_options
def chat(
    model: ModelArg,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
    no_think: Annotated[bool, typer.Option("--no-think", help="Answer without a thinking block.")] = False,
    n_predict: NPredict = -1,
    temp: Temp = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    frequency_penalty: FreqPenalty = 0.0,
    presence_penalty: PresencePenalty = 0.0,
    seed: Seed = -1,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags and --preset (with_stream_options)
    trace: TraceOut = None,
) -> None:
    """Multi-turn chat. Reads one user turn per line (from a terminal or a pipe); Ctrl-C stops a reply,
    /reset starts over, /exit or end of input quits. Sampling defaults are Qwen3's recommendations
    (thinking: temp 0.6, top-k 20, top-p 0.95; --no-think: 0.7, 20, 0.8); Qwen2 models never think, use the
    latter and Qwen2.5's default system prompt."""
    overrides = dict(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=None if seed < 0 else seed,
    )
    sampler_params(not no_think, **overrides).check()  # a bad value fails before the file is read
    gf, cfg = probe(model)
    check_trace(trace, cfg)
    sampler = Sampler(sampler_params(thinks(gf.arch, not no_think), **overrides))  # Qwen2 never thinks
    with open_session(gf, options, ctx_size, threads, trace=trace, lazy_kernels=True) as s:
        gen = Generator(s.model, s.model.new_state(), sampler, s.tokenizer.eog_ids, on_prefill=prefill_progress())
        conv = Conversation(gen, s.tokenizer, system=system, think=not no_think, n_predict=n_predict, arch=s.cfg.arch)
        _repl(s, gen, conv)


def _repl(s, gen, conv) -> None:
    tty = sys.stdin.isatty()
    if tty:
        print("chat: one message per line; Ctrl-C stops a reply, /reset starts over, /exit quits.", file=sys.stderr)
    while True:
        try:
            if tty:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            conv.reset()
            continue
        try:
            for piece in conv.send(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        except ModelFileChanged:
            raise  # the weights under us are gone: nothing sensible to continue with
        except StreamerError as e:  # e.g. the context is full: the session survives
            print(f"\nerror: {e}; /reset starts a new conversation", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{gen.stats.line()}]", file=sys.stderr)
    s.report(sys.stderr)
