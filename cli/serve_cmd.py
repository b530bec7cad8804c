"""`stream-run serve`: an OpenAI-compatible HTTP server (streamer/server) that keeps the model, its expert
cache and its KV cache warm between requests. Needs the `[serve]` extra (starlette, uvicorn)."""

from __future__ import annotations

import dataclasses
import socket
import sys
from typing import Annotated, Optional

import typer

from streamer.cli.common import open_session, probe
from streamer.cli.options import CtxSize, ModelArg, Threads, with_stream_options
from streamer.errors import StreamerError
from streamer.io import parse_size
from streamer.options import StreamOptions
from streamer.server.engine import Engine
from streamer.server.schemas import Limits
from streamer.session import run_budget

INSTALL_HINT = "stream-run serve needs the server extra: pip install 'stream-run[serve]'"


@with_stream_options
def serve(
    model: ModelArg,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    alias: Annotated[
        Optional[str],
        typer.Option(
            "--alias",
            help="Model name in /v1/models and responses [default: the file name without .gguf].",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        Optional[str],
        typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' (401 otherwise; /health stays open)."),
    ] = None,
    parallel: Annotated[
        Optional[int],
        typer.Option(
            "--parallel",
            "-np",
            help="Requests decoded together (continuous batching; each slot's KV cache counts in the RAM budget) "
            "[default: 4 if four contexts' KV caches take at most an eighth of the budget, else 2 or 1].",
            show_default=False,
        ),
    ] = None,
    queue: Annotated[
        int, typer.Option("--queue", help="Requests that may wait while the slots are busy; more get 503.")
    ] = 8,
    max_body: Annotated[str, typer.Option("--max-body", help="Largest request body (413 beyond).")] = "4M",
    max_tokens: Annotated[
        Optional[int],
        typer.Option(
            "--max-tokens",
            help="Largest max_tokens a request may ask for, and the default [default: the context size].",
            show_default=False,
        ),
    ] = None,
    max_messages: Annotated[int, typer.Option("--max-messages", help="Most messages in one chat request.")] = 256,
    ctx_size: CtxSize = None,
    threads: Threads = None,
    options: Optional[StreamOptions] = None,  # the memory/streaming flags and --preset (with_stream_options)
) -> None:
    """OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /health, /tokenize,
    /detokenize, /metrics. Up to --parallel requests decode together, more wait in a FIFO queue; each slot's KV
    cache is reused by requests that share a prompt prefix. Loads the model after the socket is bound (/health:
    503, then 200)."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise StreamerError(INSTALL_HINT) from None
    from streamer.server.app import ServerOptions, create_app  # starlette: the optional serve extra

    body = _checked(queue, max_tokens, max_messages, port, max_body)
    if parallel is not None and parallel < 1:
        raise StreamerError(f"--parallel must be at least 1, got {parallel}")
    gf, cfg = probe(model)  # a file we can run, checked before the socket is bound
    n_ctx = cfg.context(ctx_size)
    if parallel is None:
        parallel = default_parallel(run_budget(gf, cfg, options, ctx_size), cfg.state_bytes(n_ctx))
    options = dataclasses.replace(options, n_seq=parallel)
    opts = ServerOptions(
        alias or model.name.removesuffix(".gguf"),
        api_key,
        Limits(max_body_bytes=body, max_tokens=max_tokens, max_messages=max_messages),
    )

    def load() -> Engine:
        s = open_session(gf, options, ctx_size, threads)
        where = "read into memory" if s.gf.in_memory else "used in place"
        print(
            f"model loaded: {opts.alias}, context {s.model.n_ctx} tokens, {parallel} parallel, {where}", file=sys.stderr
        )
        return Engine(s, queue_size=queue, parallel=parallel)

    _serve(uvicorn, lambda on_fatal: create_app(load, opts, on_fatal), host, port, opts.alias)


def _serve(uvicorn, app_for, host: str, port: int, alias: str) -> None:
    """Bind the socket, then serve the app that app_for(on_fatal) makes until stopped (Ctrl-C, or a fatal error
    of the engine, which on_fatal records and which is raised here once the server has stopped)."""
    fatal: list[BaseException] = []
    server = None

    def on_fatal(e: BaseException) -> None:
        fatal.append(e)
        server.should_exit = True

    app = app_for(on_fatal)
    sock, shown = _bound(host, port)
    print(f"listening on http://{shown}:{port}/v1 (model '{alias}' loading; /health says when ready)", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    if fatal:
        raise fatal[0]


def default_parallel(budget: int, state_bytes: int) -> int:
    """--parallel's default: 4 slots, as llama-server's, when four sequences' states take at most an eighth
    of the RAM budget; else 2, else 1."""
    for n in (4, 2):
        if n * state_bytes <= budget // 8:
            return n
    return 1


def _checked(queue: int, max_tokens: int | None, max_messages: int, port: int, max_body: str) -> int:
    """The server's own flags checked (one error line each); the body limit in bytes."""
    if queue < 0:
        raise StreamerError(f"--queue must be >= 0, got {queue}")
    if max_tokens is not None and max_tokens < 1:
        raise StreamerError(f"--max-tokens must be >= 1, got {max_tokens}")
    if max_messages < 1:
        raise StreamerError(f"--max-messages must be >= 1, got {max_messages}")
    if not 0 < port < 65536:
        raise StreamerError(f"--port must be in 1..65535, got {port}")
    body = parse_size(max_body)
    if body < 1:
        raise StreamerError(f"--max-body must be positive, got {max_body}")
    return body


def _bound(host: str, port: int):
    """(a socket bound to host:port, the host as a URL shows it); one error line if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StreamerError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock, f"[{host}]" if family == socket.AF_INET6 else host
