#!/usr/bin/env python
"""Two source trees of stream-run side by side: prefill and decode speed of each, in alternating rounds.

    git worktree add /tmp/old <commit>
    python bench/tree_ab.py /tmp/old . MODEL.gguf --rounds 5
    python bench/tree_ab.py /tmp/old . MOE.gguf --ram-budget 8G --cap 8G --evict   # streamed, under a cgroup cap

Each run is a fresh process importing `streamer` from one tree (PYTHONPATH, with that tree's numba cache),
opening the model with the given options and calling streamer.bench.run_bench (--pp prefill, --tg greedy
decode steps). A first unmeasured run per tree compiles or loads its kernels. Rounds alternate which tree goes
first. Prints each run (a streamed one with its expert hit rate and MiB read per decoded token), then per tree
the median and range of prefill and decode tok/s, and the ratio of the medians (new / old). --cap runs each
process in a memory cgroup (bench/cgroup.py; --evict drops the model from the page cache before each run, so
the cap counts its pages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys
from streamer.bench import run_bench
from streamer.options import StreamOptions
from streamer.session import open_model
a = json.loads(sys.argv[1])
opts = StreamOptions(ram_budget=a["ram_budget"], stream=not a["no_stream"], learn=False)
with open_model(a["model"], opts, n_ctx=a["pp"] + a["tg"] + 8) as s:
    r = run_bench(s, a["pp"], a["tg"])
print(json.dumps({"pp": r["pp_tok_s"], "tg": r["tg_tok_s"], "tokens": r["tokens"][:8],
                  "hit": r.get("expert_hit_rate"), "read_mib": r.get("read_bytes_per_token", 0) / 2**20}))
"""


def run(tree: Path, a) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    arg = json.dumps({k: getattr(a, k) for k in ("model", "pp", "tg", "ram_budget", "no_stream")})
    cmd = [sys.executable, "-c", CHILD, arg]
    if a.cap:
        here = Path(__file__).resolve().parent
        evict = ["--evict", a.model] if a.evict else []
        cmd = [sys.executable, str(here / "cgroup.py"), "run", "--cap", a.cap, *evict, "--", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.exit(f"{tree}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(lines[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("model")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--cap", default=None, help="run each process under a memory cgroup of this size")
    ap.add_argument("--evict", action="store_true", help="drop the model from the page cache before each run")
    a = ap.parse_args(argv)
    trees = {"old": a.old, "new": a.new}
    for name, tree in trees.items():  # compile or load each tree's kernels, unmeasured
        print(f"warm-up {name}: {run(tree, a)}", flush=True)
    got: dict[str, list] = {"old": [], "new": []}
    for i in range(a.rounds):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            r = run(trees[name], a)
            got[name].append(r)
            streamed = f", hit rate {r['hit']:.3f}, {r['read_mib']:.0f} MiB read per token" if r.get("hit") else ""
            print(f"round {i + 1} {name}: pp {r['pp']:.2f} tok/s, tg {r['tg']:.2f} tok/s{streamed}", flush=True)
    if got["old"][0]["tokens"] != got["new"][0]["tokens"]:
        print("note: the two trees decoded different tokens", flush=True)
    med = {}
    for name in ("old", "new"):
        for k in ("pp", "tg"):
            xs = [r[k] for r in got[name]]
            med[name, k] = statistics.median(xs)
            print(f"{name} {k}: median {med[name, k]:.2f} tok/s (range {min(xs):.2f}-{max(xs):.2f})")
    for k in ("pp", "tg"):
        print(f"new/old {k}: {med['new', k] / med['old', k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
