"""Entry point: registers the commands on the app. numba and the kernels load only when a model is opened, so
--help and bad input answer in tenths of a second. main() first lets cli/early.py start reading a `run` or
`chat` model (stdlib, numpy and the header parser only), before typer and the commands are imported: the disk
works while the CLI loads. It then builds only the command it was asked for (typer turns every registered
command's signature into click parameters before it parses anything: 0.16 s for all of them, most of a one-off
run's CLI time)."""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading

from streamer import timing
from streamer.cli import early

# command name -> (module in streamer.cli, function), in the order `stream-run --help` lists them
COMMANDS = {
    "run": ("run_cmd", "run"),
    "chat": ("run_cmd", "chat"),
    "perplexity": ("perplexity_cmd", "perplexity"),
    "serve": ("serve_cmd", "serve"),
    "bench": ("bench_cmd", "bench"),
    "profile": ("bench_cmd", "profile"),
    "replay": ("replay_cmd", "replay"),
    "plan": ("plan_cmd", "plan"),
    "inspect": ("info_cmd", "inspect"),
    "tokenize": ("tokenize_cmd", "tokenize"),
    "synth": ("synth_cmd", "synth"),
    "demo": ("demo_cmd", "demo"),
    "warmup": ("warmup_cmd", "warmup"),
    "presets": ("presets_cmd", "presets"),
    "profiles": ("presets_cmd", "presets"),  # the command's name before presets were called presets (hidden)
}
HIDDEN = {"profiles"}


def _function(name: str):
    module, attr = COMMANDS[name]
    return getattr(importlib.import_module(f"streamer.cli.{module}"), attr)


def _build_app(only: str | None = None):
    """The typer app with every command registered; only: just that one (and a no-op callback, so typer
    keeps it a subcommand: `stream-run run ...` parses, helps and fails exactly as with all of them)."""
    from streamer.cli.app import app, new_app  # typer: after early.start has set the disk to work

    if only in COMMANDS:
        one = new_app()
        one.callback()(_no_options)
        one.command(only, hidden=only in HIDDEN)(_function(only))
        return one
    for name in COMMANDS:
        app.command(name, hidden=name in HIDDEN)(_function(name))
    return app


def _no_options() -> None:
    """(The group's callback of a one-command app: no options, nothing to do.)"""


def __getattr__(name: str):
    """`app`, the typer app with every command registered, built at first use (tests import it)."""
    if name == "app":
        globals()["app"] = _build_app()
        return globals()["app"]
    raise AttributeError(name)


def main() -> None:
    try:
        early.start(sys.argv)
        app = _build_app(sys.argv[1] if len(sys.argv) > 1 else None)
    except KeyboardInterrupt:  # Ctrl-C before the app runs: as the app's own (no traceback, the shell's code)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    try:
        app()
    except SystemExit as e:
        if "numba" not in sys.modules:  # nothing heavy loaded (--help, a bad flag): the usual exit is quick
            raise
        leave(e.code)


def leave(code) -> None:
    """Exit without the interpreter's teardown: after a model run, freeing every object and numba's loaded
    code libraries one by one took 0.2-0.4 s, part of every command's wall time. What exit owes is done first:
    other threads that are not daemons are joined, the atexit handlers run (weakref finalizers, the
    STREAM_RUN_TIMING line), stdout and stderr are flushed. code: as SystemExit's (None 0, a string printed, 1)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    timing.mark("exit")  # what is left: the atexit handlers, flushing, the kernel's teardown of the process
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
