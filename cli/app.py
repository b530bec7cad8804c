"""The typer app with one error policy: a StreamerError or an I/O error is one line on stderr and exit 2;
Ctrl-C is exit 130 without a traceback."""

from __future__ import annotations

import functools
import logging
import os
import sys

import typer

from streamer.errors import StreamerError


def fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


class StderrLog(logging.Handler):
    """The library's log lines on stderr as stream-run prints them: warnings as 'warning: ...', the rest as
    they are; a record with extra={"end": ""} leaves its line open (a ' done in X s' follows)."""

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "warning: " if record.levelno == logging.WARNING else ""  # errors carry their own words
        print(prefix + record.getMessage(), end=getattr(record, "end", "\n"), file=sys.stderr, flush=True)


def log_to_stderr() -> None:
    """Show the library's INFO and WARNING lines on stderr (once per process)."""
    log = logging.getLogger("streamer")
    if not any(isinstance(h, StderrLog) for h in log.handlers):
        log.addHandler(StderrLog())
        log.setLevel(logging.INFO)


def _guard(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        log_to_stderr()
        try:
            return f(*args, **kwargs)
        except StreamerError as e:
            raise fail(str(e)) from None
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a tool killed by SIGPIPE
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            raise typer.Exit(128 + 13) from None
        except OSError as e:  # disk full, unreadable file, broken pipe: no traceback
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            raise fail(f"{e.strerror or e}{where}") from None
        except MemoryError:
            raise fail("out of memory (try a smaller --ram-budget or -c/--ctx-size)") from None
        except KeyboardInterrupt:  # Ctrl-C while loading or between steps: no traceback, the shell's code
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper


class App(typer.Typer):
    """typer.Typer whose commands all go through _guard, and whose command-line errors (unknown option, bad
    value, missing argument) are one line too, instead of click's usage text and box."""

    def __call__(self, args=None, prog_name: str = "stream-run"):
        command = typer.main.get_command(self)
        try:
            code = command.main(args=args, prog_name=prog_name, standalone_mode=False)
        except typer.Abort:  # Ctrl-C outside a command (while parsing)
            sys.exit(130)
        except Exception as e:  # click's usage errors (typer vendors click: match what they provide)
            if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
                raise
            ctx = getattr(e, "ctx", None)
            if not e.format_message().strip() and ctx is not None:  # no arguments at all: the help, as before
                print(ctx.get_help())
                sys.exit(e.exit_code)
            where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"error: {' '.join(e.format_message().split())}{where}", file=sys.stderr)
            sys.exit(e.exit_code)
        sys.exit(code if isinstance(code, int) else 0)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def deco(f):
            register(_guard(f))
            return f

        return deco


def new_app() -> App:
    return App(
        help="Run Qwen3 and Qwen3-MoE GGUF models, streaming MoE experts from disk under a RAM budget.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )


app = new_app()
