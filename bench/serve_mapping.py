#!/usr/bin/env python
"""serve's model in place (--mmap) against read into memory (serve's default when the copy fits), alternating:
the time until /health says ready, then R sequential /v1/completions requests of a P-token prompt and N greedy
tokens each, timed by the client (prefill: the time to the first streamed token; decode: the tokens after it).

    python bench/serve_mapping.py MODEL.gguf [--rounds 2] [--requests 3] [--prompt-tokens 128] [--max-tokens 32]

The page cache is kept warm (the file read once first, and again before every server where --rewarm), so the
in-place server starts from a cached file, its best case. Never run in CI."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from serve_common import Server  # noqa: E402

from streamer import machine  # noqa: E402

VARIANTS = {"in place (--mmap)": ["--mmap"], "in memory (default)": []}


def one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tok/s after it) of one streamed greedy completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
            if event.get("choices") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first) if n > 1 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rewarm", action="store_true", help="read the file through the page cache before every server")
    a = ap.parse_args()
    print(machine.line(machine.describe()))
    subprocess.run(["cat", a.model], stdout=subprocess.DEVNULL, check=True)
    res: dict[str, list] = {k: [] for k in VARIANTS}
    names = list(VARIANTS)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if a.rewarm:
                subprocess.run(["cat", a.model], stdout=subprocess.DEVNULL, check=True)
            srv = Server(a.model, ["--no-learn", "-c", "1024", "-np", "1", *VARIANTS[name]], evict=False)
            try:
                runs = [
                    one(srv.url, [1000 + (7 * i + 13 * q) % 5000 for i in range(a.prompt_tokens)], a.max_tokens)
                    for q in range(a.requests)
                ]
            finally:
                srv.stop()
            ttft = statistics.median(t for t, _ in runs)
            tg = statistics.median(s for _, s in runs)
            res[name].append((srv.ready_s, a.prompt_tokens / ttft, tg))
            print(
                f"round {r}: {name:20} ready {srv.ready_s:5.1f} s  prefill {a.prompt_tokens / ttft:6.2f} tok/s  "
                f"decode {tg:6.2f} tok/s",
                flush=True,
            )
    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) for i in range(3)]
        print(f"median {name:20} ready {med[0]:5.1f} s  prefill {med[1]:6.2f} tok/s  decode {med[2]:6.2f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
