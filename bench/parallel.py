#!/usr/bin/env python
"""Batched decoding: `stream-run bench --parallel N` for several N side by side, alternating rounds, in RAM or under
a memory cgroup cap; optionally llama.cpp's batched decode (bench/llama_parallel.py) in the same rounds.

    python bench/parallel.py MOE.gguf --parallel 1 2 4 --rounds 3 --llama-python LLAMA_PYTHON
    python bench/parallel.py MOE.gguf --parallel 1 2 4 --rounds 3 --cap 8G --ram-budget 8G

In RAM (no --cap) the page cache is left warm and every stream-run run uses the weights in place (the default
budget keeps a model that fits). With --cap every stream-run run is a fresh process in a fresh memory cgroup
(bench/cgroup.py) after the model was evicted from the page cache. Each round runs every N once, the order
reversed every other round, then (with --llama-python, never under a cap) one bench/llama_parallel.py sweep of
the same N, threads, pp and tg, followed by one untimed stream-run run (the run after llama.cpp's was the round's
slowest, whichever N it was: llama.cpp's repacked copy had pushed part of the file out of the page cache). Before every stream-run run the guest's free page reporting must have been idle for
--settle seconds at a trickle (memory the previous run freed is otherwise still being handed back to the host, with
CPU steal, while this one is timed). Prints each run, then per N the medians: aggregate and per-sequence decode tok/s,
the ratio of the aggregate to N=1's (of the same round, then the median), the expert bytes read per generated
token, the distinct experts per layer per step, the hit rate and, under a cap, the cgroup's peak and OOM kills.
Root and the cgroup-v1 memory controller are needed for --cap; never run in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

from streamer import machine  # noqa: E402

KEYS = (
    "tg_tok_s",
    "aggregate_tg_tok_s",
    "pp_tok_s",
    "read_bytes_per_token",
    "experts_per_step",
    "expert_hit_rate",
    "io_stall_share",
    "shared_bytes_per_token",
    "weight_bytes_per_token",
    "tg_step_ms",
    "peak_rss_bytes",
)


def settle(window: float, most_mib: float = 64.0, limit: float = 120.0) -> None:
    """Wait until the guest's free page reporting hands back less than most_mib per `window` seconds (at most
    `limit` s). Unlike cgroup.settle's wait for silence: with the page cache full, reclaim keeps reporting a few
    tens of MiB every few seconds, while a run's freed gigabytes report at hundreds of MiB per second."""
    try:
        with open(cgroup.REPORTED) as f:
            last = int(f.read())
    except (OSError, ValueError):
        return
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        time.sleep(window)
        with open(cgroup.REPORTED) as f:
            now = int(f.read())
        if (now - last) / 1024 < most_mib:
            return
        last = now


def run_stream(a, n: int) -> dict:
    if a.settle:  # memory another run freed is still being reported to the host: its steal would land in this run
        settle(a.settle)
    exe = shutil.which("stream-run") or str(Path(sys.executable).parent / "stream-run")
    cmd = [exe, "bench", a.model, "--pp", str(a.pp), "--tg", str(a.tg), "-t", str(a.threads), "--json"]
    cmd += ["--parallel", str(n)] + (["--ram-budget", a.ram_budget] if a.ram_budget else [])
    if a.cap:
        cgroup.evict_all([a.model])
        res = cgroup.run_capped(cmd, a.cap, timeout=a.timeout)
        out, rc, stdout, stderr = res.summary(), res.returncode, res.stdout, res.stderr
    else:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        out, rc, stdout, stderr = {}, p.returncode, p.stdout, p.stderr
    out.update(engine="stream-run", n=n, returncode=rc)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        r = json.loads(lines[-1])
        out.update({k: r.get(k) for k in KEYS})
        out["machine_during"] = r.get("machine_during")
    else:
        out["stderr"] = stderr[-1500:]
    return out


def run_llama(a, ns: list[int]) -> list[dict]:
    script = Path(__file__).resolve().parent / "llama_parallel.py"
    cmd = [a.llama_python, str(script), a.model, "--parallel", *map(str, ns), "--pp", str(a.pp), "--tg", str(a.tg)]
    with tempfile.TemporaryDirectory() as d:
        out_json = Path(d) / "llama.json"
        cmd += ["--threads", str(a.threads), "--no-check", "--json", str(out_json)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if p.returncode != 0:
            return [{"engine": "llama.cpp", "n": n, "returncode": p.returncode, "stderr": p.stderr[-1500:]} for n in ns]
        data = json.loads(out_json.read_text())
    return [
        {
            "engine": "llama.cpp",
            "n": row["n_parallel"],
            "returncode": 0,
            "tg_tok_s": row["seq_tok_s"],
            "aggregate_tg_tok_s": row["agg_tok_s"],
            "pp_tok_s": row["prefill_tok_s"],
            "step_ms": row["step_ms"],
        }
        for row in data["results"]
    ]


def show(i: int, r: dict) -> None:
    if "aggregate_tg_tok_s" not in r:
        print(f"round {i + 1} {r['engine']} N={r['n']}: FAILED {r.get('stderr', '')[-400:]}", flush=True)
        return
    extra = ""
    if r["engine"] == "stream-run":
        eps = r.get("experts_per_step")
        extra = (
            f", {r['read_bytes_per_token'] / 2**20:.0f} MiB read/token, "
            + (f"{eps:.1f} experts/layer/step, " if eps else "")
            + f"hit {100 * (r['expert_hit_rate'] or 0):.1f}%, stall {100 * r['io_stall_share']:.0f}%"
            + (f", peak {r.get('max_usage_bytes', 0) / 2**30:.2f} GiB" if "max_usage_bytes" in r else "")
        )
    print(
        f"round {i + 1} {r['engine']} N={r['n']}: {r['aggregate_tg_tok_s']:.2f} tok/s in all, "
        f"{r['tg_tok_s']:.2f} per sequence, prefill {r['pp_tok_s']:.2f}{extra}",
        flush=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=32)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--cap", default=None, help="memory cgroup cap, e.g. 8G (page cache included)")
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (in RAM only)")
    ap.add_argument("--settle", type=float, default=5.0, help="a window of quiet free page reporting before a run")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if a.cap and a.llama_python:
        ap.error("--llama-python runs in RAM only (llama.cpp's mmap under a cap is another benchmark)")
    print(
        f"{machine.line(machine.describe())}; cap {a.cap or 'none'}, budget {a.ram_budget or 'default'}, "
        f"pp {a.pp}, tg {a.tg}, threads {a.threads}",
        flush=True,
    )
    runs: list[tuple[int, dict]] = []
    for i in range(a.rounds):
        for n in a.parallel if i % 2 == 0 else a.parallel[::-1]:
            r = run_stream(a, n)
            runs.append((i, r))
            show(i, r)
        if a.llama_python:
            for r in run_llama(a, a.parallel):
                runs.append((i, r))
                show(i, r)
            # llama.cpp's repacked copy pushed part of the file out of the page cache and its exit frees 17 GB:
            # the next run, whichever N, was the round's slowest (2026-12-06). One untimed run absorbs that.
            warm = run_stream(argparse.Namespace(**{**vars(a), "pp": 1, "tg": 2}), 1)
            print(f"round {i + 1}: an untimed stream-run run after llama.cpp's (exit {warm['returncode']})", flush=True)
    engines = ["stream-run"] + (["llama.cpp"] if a.llama_python else [])
    print(
        "\n| engine | N | aggregate tok/s median (range) | x N=1 (median of rounds) | per sequence | MiB read/token "
        "| experts/layer/step | hit rate | peak GiB | OOM kills |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for eng in engines:
        one = {
            i: r["aggregate_tg_tok_s"]
            for i, r in runs
            if r["engine"] == eng and r["n"] == 1 and "aggregate_tg_tok_s" in r
        }
        for n in a.parallel:
            rs = [(i, r) for i, r in runs if r["engine"] == eng and r["n"] == n]
            ok = [(i, r) for i, r in rs if "aggregate_tg_tok_s" in r]
            if not ok:
                print(f"| {eng} | {n} | failed | | | | | | | |")
                continue
            agg = [r["aggregate_tg_tok_s"] for _, r in ok]
            ratio = [r["aggregate_tg_tok_s"] / one[i] for i, r in ok if one.get(i)]

            def med(k, rows=ok):
                vals = [r[k] for _, r in rows if r.get(k) is not None]
                return statistics.median(vals) if vals else None

            mib, eps, hit = med("read_bytes_per_token"), med("experts_per_step"), med("expert_hit_rate")
            peak = med("max_usage_bytes")
            kills = sum(bool(r.get("oom_killed")) or r.get("oom_kill_count", 0) > 0 for _, r in rs)
            print(
                f"| {eng} | {n} | {statistics.median(agg):.2f} ({min(agg):.2f}-{max(agg):.2f}) "
                f"| {statistics.median(ratio):.2f}x | {med('tg_tok_s'):.2f} "
                f"| {'' if mib is None else f'{mib / 2**20:.0f}'} | {'' if eps is None else f'{eps:.1f}'} "
                f"| {'' if hit is None else f'{100 * hit:.1f}%'} | {'' if peak is None else f'{peak / 2**30:.2f}'} "
                f"| {kills if eng == 'stream-run' and a.cap else ''} |"
            )
    if a.json_out:
        a.json_out.write_text(json.dumps([{"round": i, **r} for i, r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
