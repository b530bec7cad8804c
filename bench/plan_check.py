#!/usr/bin/env python
"""Check `stream-run replay` and `stream-run plan` against live runs (issue 14). For the lead, on a quiet machine.

    /opt/venv/bin/python bench/plan_check.py                       # the 30B-A3B file at 6G, 8G, 12G
    /opt/venv/bin/python bench/plan_check.py MODEL.gguf --budgets 6G,8G,12G --pp 128 --tg 64
    /opt/venv/bin/python bench/plan_check.py MODEL.gguf --budgets 300M --no-cap --pp 16 --tg 16   # smoke test

Per budget B (each run starts with the model evicted from the page cache, and under a cgroup-v1 memory cap of
B unless --no-cap; bench/cgroup.py):
1. live: `stream-run bench MODEL --ram-budget B --pp P --tg T --trace TRACE --json` (prefill, then greedy decode;
   its decode-phase hit rate, MiB read per token and tok/s are the measured figures);
2. `stream-run replay TRACE --budget BUDGETS --json`: the trace's own live figures, the replay at the recorded
   cache, and every policy at every budget;
3. `stream-run plan MODEL --ram-budget BUDGETS --trace TRACE --json`: predicted decode tok/s at B (run uncapped:
   it times a warm decode step); and once without --trace (the uniform-routing bound).
Prints one table: live vs replay hit rate (target: within 1 point) and bytes per token (within 2%), and plan's
predicted vs measured tok/s (within 25%; "serial" is the bound if no read overlapped compute, "uniform"
the prediction without the trace). Writes the raw JSON of every step to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

STREAM_RUN = str(Path(sys.executable).parent / "stream-run")
DEFAULT_MODEL = "/work/models/qwen3-30b-a3b-Q4_K.gguf"


def run(cmd, cap=None, timeout=3600):
    print("$ " + " ".join(map(str, cmd)) + (f"   [cgroup cap {cap}]" if cap else ""), file=sys.stderr, flush=True)
    res = cgroup.run_capped([str(c) for c in cmd], cap, capture=True, timeout=timeout)
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"failed ({res.returncode}, oom_killed={res.oom_killed}): {' '.join(map(str, cmd))}")
    return res


def parse_size(text: str) -> int:
    from streamer.io import parse_size as parse

    return parse(text)


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--budgets", default="6G,8G,12G")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--no-cap", action="store_true", help="run the live benches without a cgroup cap")
    ap.add_argument("--random-decode", action="store_true", help="pass --random-decode to bench")
    ap.add_argument("--out-dir", default="/tmp/plan_check")
    ap.add_argument("--plot-dir", help="also write replay-B.png and plan-B.png here (needs matplotlib)")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b in [x.strip() for x in a.budgets.split(",") if x.strip()]:
        trace = out / f"trace-{b}.npz"
        cgroup.evict(a.model)
        extra = ["--random-decode"] if a.random_decode else []
        live = run(
            [
                STREAM_RUN,
                "bench",
                a.model,
                "--ram-budget",
                b,
                "--pp",
                a.pp,
                "--tg",
                a.tg,
                "--trace",
                trace,
                "--json",
                *extra,
            ],
            cap=None if a.no_cap else b,
        )
        bench = last_json(live.stdout)
        pics = {}
        if a.plot_dir:
            Path(a.plot_dir).mkdir(parents=True, exist_ok=True)
            pics = {k: ["--plot", str(Path(a.plot_dir) / f"{k}-{b}.png")] for k in ("replay", "plan")}
        rep = last_json(
            run(
                [
                    STREAM_RUN,
                    "replay",
                    trace,
                    "--json",
                    *pics.get("replay", []),
                    "--budget",
                    ",".join(x.strip() for x in a.budgets.split(",")),
                    "--policy",
                    "lru,pinned-lru,lfu,per-layer,belady",
                ]
            ).stdout
        )
        plan = last_json(
            run(
                [
                    STREAM_RUN,
                    "plan",
                    a.model,
                    "--trace",
                    trace,
                    "--json",
                    *pics.get("plan", []),
                    "--ram-budget",
                    ",".join(x.strip() for x in a.budgets.split(",")),
                ]
            ).stdout
        )
        uni = last_json(run([STREAM_RUN, "plan", a.model, "--ram-budget", b, "--json"]).stdout)
        for name, doc in (("bench", bench), ("replay", rep), ("plan", plan), ("plan-uniform", uni)):
            (out / f"{name}-{b}.json").write_text(json.dumps(doc, indent=1))
        lv, rp = rep["live"]["decode"], rep["recorded"]["replay"]["decode"] if rep["recorded"] else None
        pred = next(r for r in plan["rows"] if r["policy"] == plan["policy"] and r["budget"] == parse_size(b))
        upred = uni["rows"][0]
        rows.append(
            {
                "budget": b,
                "cap": None if a.no_cap else b,
                "cgroup_peak_bytes": live.max_usage_bytes,
                "bench_hit": bench["expert_hit_rate"],
                "trace_hit": lv["hit_rate"],
                "replay_hit": rp["hit_rate"] if rp else None,
                "bench_mib_tok": bench["read_bytes_per_token"] / 2**20,
                "trace_mib_tok": lv["read_bytes_per_token"] / 2**20,
                "replay_mib_tok": rp["read_bytes_per_token"] / 2**20 if rp else None,
                "measured_tok_s": bench["tg_tok_s"],
                "plan_tok_s": pred.get("decode_tok_s"),
                "plan_serial_tok_s": pred.get("decode_tok_s_serial"),
                "plan_uniform_tok_s": upred.get("decode_tok_s"),
                "plan_hit": pred.get("hit_rate"),
                "disk_GBps": plan["disk"]["throughput_Bps"] / 1e9,
                "step_ms": 1e3 * plan["decode_step_s"],
            }
        )
    print(
        f"\n{'budget':>7} {'hit live':>9} {'replay':>7} {'MiB/tok live':>13} {'replay':>7} {'tok/s meas':>10} "
        f"{'plan':>6} {'err':>6} {'serial':>8} {'uniform':>8} {'peak GiB':>8}"
    )
    ok = True
    for r in rows:
        hit_ok = r["replay_hit"] is not None and abs(r["replay_hit"] - r["bench_hit"]) <= 0.01
        bytes_ok = r["replay_mib_tok"] is not None and abs(r["replay_mib_tok"] - r["bench_mib_tok"]) <= 0.02 * max(
            r["bench_mib_tok"], 1e-9
        )
        err = (r["plan_tok_s"] - r["measured_tok_s"]) / r["measured_tok_s"] if r["plan_tok_s"] else None
        plan_ok = err is not None and abs(err) <= 0.25
        ok = ok and hit_ok and bytes_ok and plan_ok
        print(
            f"{r['budget']:>7} {pct(r['bench_hit']):>9} {pct(r['replay_hit']):>7} {r['bench_mib_tok']:13.1f} "
            f"{r['replay_mib_tok'] or 0:7.1f} {r['measured_tok_s']:10.2f} {r['plan_tok_s'] or 0:6.2f} "
            f"{pct(err):>6} {r['plan_serial_tok_s'] or 0:8.2f} {r['plan_uniform_tok_s'] or 0:8.2f} "
            f"{r['cgroup_peak_bytes'] / 2**30:8.2f}"
            f"  {'ok' if hit_ok and bytes_ok and plan_ok else 'MISS'}"
        )
    print(
        f"(disk probe {rows[0]['disk_GBps']:.2f} GB/s, warm decode step {rows[0]['step_ms']:.0f} ms; raw JSON in {out})"
        if rows
        else ""
    )
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
