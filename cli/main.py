"""Entry point: registers the commands on the app. Heavy imports live inside the commands, so --help is instant.
main() first lets streamer/early.py start reading a `run` or `chat` model (stdlib, numpy and the header
parser only), before typer and the commands are imported: the disk works while the CLI loads."""

from __future__ import annotations

import sys


def _build_app():
    from streamer.cli.app import app
    from streamer.cli.bench_cmd import bench, profile
    from streamer.cli.demo_cmd import demo
    from streamer.cli.info_cmd import inspect
    from streamer.cli.perplexity_cmd import perplexity
    from streamer.cli.plan_cmd import plan
    from streamer.cli.presets_cmd import presets
    from streamer.cli.replay_cmd import replay
    from streamer.cli.run_cmd import chat, run
    from streamer.cli.serve_cmd import serve
    from streamer.cli.synth_cmd import synth
    from streamer.cli.tokenize_cmd import tokenize
    from streamer.cli.warmup_cmd import warmup

    for command in (
        run,
        chat,
        perplexity,
        serve,
        bench,
        profile,
        replay,
        plan,
        inspect,
        tokenize,
        synth,
        demo,
        warmup,
        presets,
    ):
        app.command()(command)
    app.command("profiles", hidden=True)(presets)  # the command's name before presets were called presets
    return app


def __getattr__(name: str):
    """`app`, the typer app with every command registered, built at first use (tests import it)."""
    if name == "app":
        globals()["app"] = _build_app()
        return globals()["app"]
    raise AttributeError(name)


def main() -> None:
    from streamer import early

    early.start(sys.argv)
    app = __getattr__("app")
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
    import atexit
    import os
    import threading

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
