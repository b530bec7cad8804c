#!/usr/bin/env python
"""Decode speed of expert skipping and expert top-p settings side by side, under a memory cgroup cap.

    python bench/skip_speed.py MOE.gguf --cap 8G --ram-budget 8G --configs 1:0,1:0.05,1:0.1,0.9:0 --rounds 3

Each config is TOP_P:SKIP. Per round every config runs once as a fresh `stream-run bench --json` process
(--pp prefill tokens, --tg greedy decode steps), the order rotating between rounds, each inside a fresh
memory cgroup whose limit counts the page cache (bench/cgroup.py) after the model has been evicted from the
page cache. Prints each run, then per config the median and range of decode tok/s, the MiB read per decoded
token, the expert hit rate, the routing weight skipped, the cgroup's peak and whether anything was
OOM-killed. Root and the cgroup-v1 memory controller are needed; never run in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

from streamer import machine  # noqa: E402


def run_one(a, top_p: float, skip: float) -> dict:
    exe = shutil.which("stream-run") or str(Path(sys.executable).parent / "stream-run")
    cmd = [exe, "bench", a.model, "--pp", str(a.pp), "--tg", str(a.tg), "--json"]
    cmd += ["--expert-top-p", str(top_p), "--expert-skip", str(skip)]
    if a.ram_budget:
        cmd += ["--ram-budget", a.ram_budget]
    cgroup.evict_all([a.model])
    res = cgroup.run_capped(cmd, a.cap, timeout=a.timeout)
    out = {"top_p": top_p, "skip": skip, "returncode": res.returncode, **res.summary()}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode == 0 and lines:
        r = json.loads(lines[-1])
        keys = ("tg_tok_s", "pp_tok_s", "read_bytes_per_token", "expert_hit_rate", "io_stall_share")
        out.update({k: r[k] for k in keys + ("skipped_weight_share", "skipped_bytes_per_token")})
        out["machine_during"] = r.get("machine_during")  # page faults and reclaim while it ran
    else:
        out["stderr"] = res.stderr[-1500:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--configs", default="1:0,1:0.02,1:0.05,1:0.1")
    ap.add_argument("--cap", default="8G")
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    configs = [tuple(float(x) for x in c.split(":")) for c in a.configs.split(",")]
    print(
        f"{machine.line(machine.describe())}; cap {a.cap}, budget {a.ram_budget or 'default'}, pp {a.pp}, tg {a.tg}",
        flush=True,
    )
    runs: dict = {c: [] for c in configs}
    for i in range(a.rounds):
        order = configs[i % len(configs) :] + configs[: i % len(configs)]
        for c in order:
            r = run_one(a, *c)
            runs[c].append(r)
            if "tg_tok_s" in r:
                print(
                    f"round {i + 1} top-p {c[0]:g} skip {c[1]:g}: tg {r['tg_tok_s']:.2f} tok/s, "
                    f"{r['read_bytes_per_token'] / 2**20:.0f} MiB/token, hit {100 * r['expert_hit_rate']:.1f}%, "
                    f"skipped weight {100 * r['skipped_weight_share']:.2f}%, peak {r.get('max_usage_bytes', 0) / 2**30:.2f} GiB",
                    flush=True,
                )
            else:
                print(f"round {i + 1} top-p {c[0]:g} skip {c[1]:g}: FAILED {r}", flush=True)
    print("\n| top-p | skip W | decode tok/s median (range) | MiB read/token | hit rate | skipped weight | OOM kills |")
    print("|---|---|---|---|---|---|---|")
    for c, rs in runs.items():
        ok = [r for r in rs if "tg_tok_s" in r]
        if not ok:
            print(f"| {c[0]:g} | {c[1]:g} | failed | | | | |")
            continue
        tg = [r["tg_tok_s"] for r in ok]

        def med(k, rows=ok):
            return statistics.median(r[k] for r in rows)

        kills = sum(bool(r.get("oom_killed")) or r.get("oom_kill_count", 0) > 0 for r in rs)
        print(
            f"| {c[0]:g} | {c[1]:g} | {statistics.median(tg):.2f} ({min(tg):.2f}-{max(tg):.2f}) "
            f"| {med('read_bytes_per_token') / 2**20:.0f} | {100 * med('expert_hit_rate'):.1f}% "
            f"| {100 * med('skipped_weight_share'):.2f}% | {kills} |"
        )
    if a.json_out:
        a.json_out.write_text(json.dumps({f"{c[0]}:{c[1]}": rs for c, rs in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
