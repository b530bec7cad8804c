"""Start reading a model before the command line is parsed: the time to first token of a one-off `run` or `chat` on a
cold file is mostly disk time, and the CLI's imports take a few tenths of a second the disk would otherwise sit idle
through.

start(argv) runs first in the entry point (cli/main.py), before typer is imported. For `run MODEL ...` and `chat MODEL
...` it reads the few flags that decide what may be read early (--ram-budget, --no-stream, --preset/--profile,
-c/--ctx-size), parses MODEL's header and starts session.start_early_pagein's background page-in of the non-expert
weights, under open_model's budget check (with RSS_MARGIN for the imports still to come). It is a hint only: - any doubt
(another command, --help, a flag it cannot read, a file that does not parse) starts nothing,
  silently; the CLI then validates and reports exactly as without it;
- a bad argument is still one line and exit 2 at once: the reads are a daemon thread's; - open_model, handed the page-in
(take_pagein, in cli/common.open_session), makes the real budget check and
  goes on with the page-in only if it asks for exactly the same ranges, else stops it.
cli/common.probe takes the parsed header (take_file) instead of parsing it again."""

from __future__ import annotations

import os

from streamer import timing

COMMANDS = ("run", "chat")
HEADER_AHEAD = 8 * 2**20  # bytes read ahead for the header parse
RSS_MARGIN = 512 * 2**20  # resident memory the process may still grow by before open_model's own check
_VALUE = {
    "--ram-budget": "ram_budget",
    "--preset": "preset",
    "--profile": "preset",
    "-c": "n_ctx",
    "--ctx-size": "n_ctx",
}
_FLAG = {"--no-stream": ("stream", False)}
_NEVER = ("-h", "--help", "--no-mmap")  # --no-mmap: the model is read whole into memory, not paged in

_held: dict = {}  # "path", "gf", "cfg", "ranges", "pagein": what start() opened and started


def flags(argv: list[str]) -> tuple[str, dict] | None:
    """(model path, {ram_budget, preset, n_ctx, stream}) of `run MODEL ...` / `chat MODEL ...`, None when
    the command is another or any of these flags is unclear (given twice, or without a value)."""
    if len(argv) < 3 or argv[1] not in COMMANDS or argv[2].startswith("-"):
        return None
    found: dict = {}
    args = argv[3:]
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if a in _NEVER:
            return None
        if name in _VALUE:
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
                i += 1
            key = _VALUE[name]
            if key in found:
                return None
            found[key] = value
        elif a in _FLAG:
            key, v = _FLAG[a]
            if key in found:
                return None
            found[key] = v
        i += 1
    return argv[2], found


def start(argv: list[str]) -> None:
    """Start the early page-in for this command line, if it is one that may (see the module's docstring)."""
    _held.clear()
    parsed = flags(argv)
    if parsed is None:
        return
    path, found = parsed
    try:
        if not os.path.isfile(path):
            return
        _read_header_ahead(path)  # the CLI reads the header whatever the flags say: have it on its way
        # numpy and the header parser import only now, while the header is on its way (and not at all for --help
        # or another command)
        from streamer import config, gguf_file, options, session

        n_ctx = int(found["n_ctx"]) if "n_ctx" in found else None
        opts = options.StreamOptions.build(
            found.get("preset"), ram_budget=found.get("ram_budget"), stream=found.get("stream", True)
        )
        gf = gguf_file.GGUFFile(path)
        cfg = config.ModelConfig.from_gguf(gf)
        timing.mark("header")
        _held.update(path=path, gf=gf, cfg=cfg)
        ranges, whole = session.early_plan(
            gf, cfg, opts, session.run_budget(gf, cfg, opts, n_ctx), n_ctx, rss_margin=RSS_MARGIN
        )
        if ranges and gf.mm is not None:
            _held.update(ranges=ranges, pagein=session.start_pagein_of(gf, ranges, whole))
    except Exception:  # a hint only: the CLI reports whatever is wrong, in its own words
        stop()
        _held.clear()


def _read_header_ahead(path: str) -> None:
    """POSIX_FADV_WILLNEED over the first HEADER_AHEAD bytes (a 30B file's header, its metadata and tokenizer,
    is about 6 MB): one large asynchronous read while numpy and gguf import, instead of the parse faulting it
    in a readahead window at a time."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, HEADER_AHEAD, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def take_file(path) -> tuple | None:
    """(GGUFFile, ModelConfig) start() parsed, if for this model path (until take_pagein is called)."""
    if "gf" not in _held or str(path) != _held["path"]:
        return None
    return _held["gf"], _held["cfg"]


def take_pagein(gf):
    """(ranges, PageIn) start() began on this GGUFFile, for open_model to go on with or stop; None if none.
    Handed out once: nothing is held afterwards (a page-in on another file is stopped)."""
    held, p, ranges = _held.get("gf"), _held.pop("pagein", None), _held.pop("ranges", None)
    _held.clear()
    if p is None:
        return None
    if held is not gf:
        p.stop()
        return None
    return ranges, p


def stop() -> None:
    """Stop a page-in start() began and nobody took (joins its thread: at most one piece's read)."""
    p = _held.pop("pagein", None)
    _held.pop("ranges", None)
    if p is not None:
        p.stop()
