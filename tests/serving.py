"""Helpers for the server tests: run the real app on uvicorn in a thread, on a socket bound to a free loopback
port, and read /metrics."""

from __future__ import annotations

import re
import socket
import threading
import time

import uvicorn

from streamer.experts.store import ExpertLayout
from streamer.generate import Generator
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.server.app import ServerOptions, create_app
from streamer.server.engine import Engine
from streamer.server.schemas import Limits
from streamer.session import open_model

# Loading a model compiles the kernels when numba's cache lacks them: 82 s for tiny-moe on an idle 2-core machine,
# longer while another test worker compiles too. The deadline guards against a hang, not a slow first load.
LOAD_TIMEOUT = 900


class Running:
    def __init__(self, session, queue_size=8, load=None, parallel=1, **opts):
        self.session = session
        limits = opts.pop("limits", Limits())
        self.options = ServerOptions(alias="tiny", limits=limits, **opts)
        self.app = create_app(load or (lambda: Engine(session, queue_size=queue_size, parallel=parallel)), self.options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    @property
    def engine(self) -> Engine:
        return self.app.state.server.engine

    def wait_loaded(self, timeout=LOAD_TIMEOUT) -> Engine:
        deadline = time.monotonic() + timeout
        while self.engine is None:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.01)
        return self.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def metrics(client, url) -> dict:
    """/metrics as {name{labels}: value}."""
    r = client.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            m = re.fullmatch(r"(\S+) (\S+)", line)
            assert m, line
            out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(client, url, timeout=30) -> dict:
    """Metrics once no generation runs or waits (a cancelled one stops at its next token)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client, url)
        if m["streamrun_busy"] == 0 and m["streamrun_queue_depth"] == 0:
            return m
        assert time.monotonic() < deadline, "the server stayed busy"
        time.sleep(0.02)


def greedy(session, ids, n):
    """The oracle of the server tests: n greedy tokens of Generator alone on `session` (no stop tokens)."""
    gen = Generator(session.model, session.model.new_state(), Sampler(SamplerParams()), frozenset())
    return list(gen.generate(ids, n))


def open_resident(path, n_ctx):
    """The oracle's session: every expert in place, no usage file."""
    return open_model(path, StreamOptions(stream=False, learn=False), n_ctx=n_ctx)


def open_streamed(path, resident, slots, n_ctx):
    """The served session: experts streamed through a cache of `slots` slots (resident: a session of the same file,
    for its slot size)."""
    slot = ExpertLayout(resident.gf, resident.cfg).slot_bytes
    return open_model(path, StreamOptions(learn=False, expert_cache_bytes=slots * slot), n_ctx=n_ctx)
