"""Helpers several commands share: progress lines, and the cheap checks of what the user typed (token ids,
prompt length, output paths) that run before a model is opened, so bad input fails before any kernel
compiles or any large read."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from streamer.cli import early
from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.filewatch import install_bus_error_exit
from streamer.gguf_file import GGUFFile
from streamer.io import human
from streamer.session import open_model
from streamer.state import check_room


def progress_printer(label: str, fmt=None, after_s: float = 0.0):
    """A (done, total) callback: redraws one stderr line on a terminal, else prints every 10%. `fmt(done,
    total)` words the counts (default: byte sizes). Silent until `after_s` seconds have passed (fast work
    prints nothing)."""
    fmt = fmt or (lambda done, total: f"{human(done)} / {human(total)}")

    tty = sys.stderr.isatty()
    last = [-1]
    start = time.monotonic()

    def show(done: int, total: int) -> None:
        if time.monotonic() - start < after_s and last[0] < 0:
            return
        pct = int(100 * done / max(total, 1))
        step = pct if tty else pct // 10 * 10
        if step == last[0]:
            return
        last[0] = step
        line = f"{label}: {fmt(done, total)} ({pct}%)"
        if tty:
            print("\r" + line, end="\n" if done >= total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    return show


def prefill_progress():
    """Progress of a prompt longer than one prefill chunk (512 tokens), on stderr."""
    return progress_printer("prefill", lambda done, total: f"{done} / {total} tokens")


def parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise StreamerError(f"--tokens must be comma-separated integers, got {text!r}") from None


def check_output_path(path: Path | None, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written: a directory, or a missing or
    read-only parent directory."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise StreamerError(f"{flag} {path} is a directory")
    if not parent.is_dir():
        raise StreamerError(f"{flag} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise StreamerError(f"{flag} {path}: permission denied")


def probe(model: Path):
    """The model file's header and config: cheap (no weights read, no kernels), to check input against."""
    held = early.take_file(model)  # parsed by the entry point already, to start reading (cli/early.py)
    if held is not None:
        return held
    gf = GGUFFile(model)
    return gf, ModelConfig.from_gguf(gf)


def check_trace(trace: Path | None, cfg) -> None:
    """--trace: a writable path, and a MoE model (a dense one has no routing to record)."""
    check_output_path(trace, "--trace")
    if trace is not None and not cfg.is_moe:
        raise StreamerError("--trace: this is a dense model: it has no experts, so there is no routing to trace")


def open_session(
    gf, options, ctx_size: int | None, threads: int | None, tokenizer=None, trace=None, lazy_kernels: bool = False
):
    """streamer.session.open_model (weights mapped, kernels compiled or loaded), once the input is checked;
    with the SIGBUS guard first (the file truncated under us: one line and exit 2, not "Bus error").
    lazy_kernels: open_model's (run and chat: cached kernels load at their first call)."""
    n = len(gf.shards)
    install_bus_error_exit(str(gf.path) if n == 1 else f"{gf.path} (or one of its {n} shards)")
    return open_model(
        gf,
        options,
        n_ctx=ctx_size,
        threads=threads,
        tokenizer=tokenizer,
        trace=trace,
        lazy_kernels=lazy_kernels,
        started_pagein=early.take_pagein(gf),  # the entry point's, if it started one on this file
        load_progress=progress_printer("reading the model into memory", after_s=0.5),
    )


def check_prompt(ids: list[int], cfg, ctx_size: int | None) -> None:
    """Token ids in the vocabulary, and a prompt that fits the context (checked again at every forward)."""
    if not ids:
        raise StreamerError("no tokens to run (the prompt is empty)")
    cfg.check_tokens(ids)
    check_room(0, len(ids), cfg.context(ctx_size))
