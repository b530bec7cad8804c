#!/usr/bin/env python
"""Decode (and prefill) speed of stream-run against llama.cpp on existing GGUF files, in alternating rounds.

    python bench/decode_ratio.py /work/models/qwen3-0.6b-{Q2_K,Q3_K_M,IQ4_XS,IQ2_XXS}.gguf --rounds 2
    python bench/decode_ratio.py /work/models/qwen2.5-coder-7b-Q4_K.gguf --pp 16 --tg 16 --rounds 1

Per file and round, each tool runs once (the order alternating between rounds), each run starting with the
file evicted from the page cache (bench/cgroup.py); stream-run as `stream-run bench --json`, llama.cpp as
bench/llama_run.py under --llama-python (default repacking). Prints one row per file: median prefill and
decode tok/s of each tool and the decode ratio stream-run / llama.cpp (issue 12's target: >= 0.9 on the dense
0.6B recipes). Never run in CI; root for a fair eviction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

LLAMA_RUN = Path(__file__).resolve().parent / "llama_run.py"


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in output:\n{text[-2000:]}")


def run_one(tool: str, path: str, a) -> dict:
    cgroup.evict(path)
    if tool == "sr":
        cmd = [a.stream_run, "bench", path, "--pp", str(a.pp), "--tg", str(a.tg), "-t", str(a.threads), "--json"]
    else:
        cmd = [a.llama_python, str(LLAMA_RUN), path, "--pp", str(a.pp), "--tg", str(a.tg), "--threads", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return last_json(p.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--stream-run", default=shutil.which("stream-run") or "stream-run")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/opt/llamavenv/bin/python"))
    ap.add_argument("--json-out", help="also write every run's figures here")
    a = ap.parse_args(argv)
    runs = []
    for path in a.models:
        for r in range(a.rounds):
            for tool in ("sr", "llama") if r % 2 == 0 else ("llama", "sr"):
                res = run_one(tool, path, a)
                pp, tg = res["pp_tok_s"], res["tg_tok_s"]
                runs.append({"model": path, "round": r, "tool": tool, "pp_tok_s": pp, "tg_tok_s": tg})
                print(f"  {Path(path).name} round {r} {tool}: pp {pp:.1f} tg {tg:.2f}", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(runs, indent=1))
    print(
        f"\n| model | stream-run pp / tg tok/s | llama.cpp pp / tg tok/s | decode ratio |  (pp {a.pp}, tg {a.tg}, "
        f"{a.threads} threads, medians of {a.rounds} rounds)"
    )
    print("|---|---|---|---|")
    for path in a.models:
        med = {
            (t, k): statistics.median(x[k] for x in runs if x["model"] == path and x["tool"] == t)
            for t in ("sr", "llama")
            for k in ("pp_tok_s", "tg_tok_s")
        }
        print(
            f"| {Path(path).name} | {med['sr', 'pp_tok_s']:.1f} / {med['sr', 'tg_tok_s']:.2f} | "
            f"{med['llama', 'pp_tok_s']:.1f} / {med['llama', 'tg_tok_s']:.2f} | "
            f"{med['sr', 'tg_tok_s'] / med['llama', 'tg_tok_s']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
