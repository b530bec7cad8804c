"""Shared by the server benchmarks: start `stream-run serve` (optionally inside a cgroup-v1 memory cap, cold
page cache), wait for /health, read /metrics, stop it. Runs under the project's venv (httpx)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from cgroup import MemoryCgroup, evict_all, parse_size  # noqa: E402

STREAM_RUN = str(Path(sys.executable).parent / "stream-run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`stream-run serve MODEL ARGS` on a free loopback port; with cap, inside a fresh memory cgroup whose
    limit counts page cache (the model file is evicted first, so the run starts cold)."""

    def __init__(
        self,
        model: str,
        args: list[str],
        cap: str | None = None,
        evict: bool = True,
        log: str | None = None,
        ready_timeout: float = 600,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if evict:
            evict_all([model])
        cmd = [STREAM_RUN, "serve", model, "--port", str(self.port), *args]
        self.cg = MemoryCgroup(parse_size(cap)).__enter__() if cap else None
        if self.cg is not None:
            cmd = self.cg.wrap(cmd)
        self.log = open(log or os.devnull, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, start_new_session=True)
        self.ready_s = self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (see the log)")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready in time")

    def metrics(self) -> dict:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            m = re.fullmatch(r"(\S+) (\S+)", line)
            if m and not line.startswith("#"):
                out[m.group(1)] = float(m.group(2))
        return out

    def peak_rss(self) -> int:
        """The server process's peak RSS (VmHWM; the cgroup wrapper execs the command, so it is this pid)."""
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024
        except (OSError, AttributeError):
            return 0

    def alive(self) -> bool:
        try:
            return self.proc.poll() is None and httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> dict:
        """SIGINT, wait; the cgroup's figures (max usage, OOM kills) if capped."""
        stats = {}
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.cg is not None:
            stats = self.cg.stats()
            self.cg.remove()
        self.log.close()
        return {"returncode": self.proc.returncode, **stats}


def wait_idle(srv: Server, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if m.get("streamrun_busy") == 0 and m.get("streamrun_queue_depth") == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]
