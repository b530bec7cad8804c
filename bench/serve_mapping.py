#!/usr/bin/env python
"""serve's model in place (the default) against read into memory (--no-mmap), alternating:
the time until /health says ready, then R sequential /v1/completions requests of a P-token prompt and N greedy
tokens each, timed by the server (its llama-server `timings`: prompt_per_second, predicted_per_second).

    python bench/serve_mapping.py MODEL.gguf [--rounds 2] [--requests 3] [--prompt-tokens 128] [--max-tokens 32]

The page cache is kept warm (the file read once first, and again before every server where --rewarm), so the
in-place server starts from a cached file, its best case. Never run in CI."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from serve_common import Server  # noqa: E402

from streamer import machine  # noqa: E402

VARIANTS = {"in place (default)": [], "in memory (--no-mmap)": ["--no-mmap"]}


def one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy completion, from the server's llama-server timings."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    t = r.json()["timings"]
    return t["prompt_per_second"], t["predicted_per_second"]


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
            pp = statistics.median(p for p, _ in runs)
            tg = statistics.median(d for _, d in runs)
            res[name].append((srv.ready_s, pp, tg))
            print(
                f"round {r}: {name:20} ready {srv.ready_s:5.1f} s  prefill {pp:6.2f} tok/s  decode {tg:6.2f} tok/s",
                flush=True,
            )
    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) for i in range(3)]
        print(f"median {name:20} ready {med[0]:5.1f} s  prefill {med[1]:6.2f} tok/s  decode {med[2]:6.2f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
