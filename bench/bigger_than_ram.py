#!/usr/bin/env python
"""A model bigger than this machine's RAM, with no cgroup (issue 12 item 4): stream-run vs llama.cpp (mmap).

    /opt/dev/bin/python bench/bigger_than_ram.py /work/models/qwen3-30b-a3b-Q8_0-00001-of-00003.gguf \
        --pp 16 --tg 16 --rounds 2 --out /tmp/btr.jsonl

The model (all of its shards) must be larger than MemTotal, else the run proves nothing and we refuse.
Each round, in alternating order: evict every shard from the page cache, then run
  * `stream-run bench FIRST --json` with the default RAM budget (no --ram-budget: 0.8 x available memory);
  * llama.cpp through bench/llama_run.py with --no-repack. Its default (repacking) copies the weights into
    anonymous memory: 32 GB of it on a 24 GB machine with no swap, which the global OOM killer answers,
    possibly by killing another process on the machine, so we do not run it here.
Both run without any memory cgroup, measured from outside by wait4 (peak RSS, bytes read from storage; see
bench/cgroup.py). Then `stream-run run` and `stream-run profile` run once each (the issue asks that run, bench
and profile all work). After every run the kernel log is checked for a new OOM kill.

Output: one JSON line per run (to --out as well) and a small table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

LLAMA_RUN = Path(__file__).resolve().parent / "llama_run.py"


def shards(first: Path) -> list[Path]:
    m = re.match(r"(.*)-00001-of-(\d{5})\.gguf$", first.name)
    if not m:
        return [first]
    n = int(m.group(2))
    return [first.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def mem_total() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def oom_kills() -> int:
    out = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    return sum("Out of memory" in line or "oom-kill" in line for line in out.splitlines())


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    return None


def measure(tool: str, cmd: list[str], files: list[Path], timeout: float) -> dict:
    left = cgroup.evict_all(files)
    before = oom_kills()
    r = cgroup.run_capped(cmd, None, capture=True, timeout=timeout)
    rec = {
        "tool": tool,
        "cmd": cmd,
        "returncode": r.returncode,
        "killed_by_signal": r.killed_by_signal,
        "new_oom_kills": oom_kills() - before,
        "wall_s": r.wall_s,
        "peak_rss_bytes": r.rusage_maxrss_bytes,
        "read_bytes": r.rusage_read_bytes,
        "cached_after_evict": sum(left.values()),
        "report": last_json(r.stdout),
    }
    if r.returncode != 0:
        rec["stderr_tail"] = r.stderr[-2000:]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("model", type=Path, help="the first shard (or the single file)")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--stream-run", default="/opt/dev/bin/stream-run")
    ap.add_argument("--llama-python", default="/opt/llamavenv/bin/python")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    files = shards(a.model)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print(f"error: missing shard(s): {', '.join(missing)}", file=sys.stderr)
        return 2
    size, ram = sum(f.stat().st_size for f in files), mem_total()
    if size <= ram:
        print(
            f"error: {a.model} is {size / 2**30:.1f} GiB, not bigger than this machine's {ram / 2**30:.1f} GiB RAM",
            file=sys.stderr,
        )
        return 2
    print(f"model {size / 2**30:.2f} GiB in {len(files)} file(s); MemTotal {ram / 2**30:.2f} GiB; no cgroup")

    sr = [a.stream_run, "bench", str(a.model), "--pp", str(a.pp), "--tg", str(a.tg), "-t", str(a.threads), "--json"]
    llama = [a.llama_python, str(LLAMA_RUN), str(a.model), "--threads", str(a.threads)]
    llama += ["--pp", str(a.pp), "--tg", str(a.tg), "--no-repack"]
    runs = []
    out = open(a.out, "a") if a.out else None
    for rnd in range(a.rounds):
        order = [("stream-run", sr), ("llama.cpp", llama)]
        for tool, cmd in order if rnd % 2 == 0 else order[::-1]:
            rec = measure(tool, cmd, files, a.timeout) | {"round": rnd + 1}
            runs.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "report"} | {"report": bool(rec["report"])}))
            if out:
                print(json.dumps(rec), file=out, flush=True)
    for tool, cmd in (
        ("stream-run run", [a.stream_run, "run", str(a.model), "-p", "def fibonacci(n):", "-n", "8"]),
        ("stream-run profile", [a.stream_run, "profile", str(a.model), "-n", "8"]),
    ):
        rec = measure(tool, cmd, files, a.timeout) | {"round": 0}
        runs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "report"} | {"report": bool(rec["report"])}))
        if out:
            print(json.dumps(rec), file=out, flush=True)

    print("\n| tool | decode tok/s | prefill tok/s | disk MiB per decoded token | peak RSS GiB | read GiB | rc / OOM |")
    print("|---|---|---|---|---|---|---|")
    for tool in ("stream-run", "llama.cpp"):
        rs = [r for r in runs if r["tool"] == tool and r["report"]]
        if not rs:
            print(f"| {tool} | failed | | | | | {[r['returncode'] for r in runs if r['tool'] == tool]} |")
            continue
        med = statistics.median
        tg = med(r["report"]["tg_tok_s"] or 0 for r in rs)
        pp = med(r["report"]["pp_tok_s"] for r in rs)
        per = med(r["report"]["read_bytes_per_token"] or 0 for r in rs) / 2**20
        rss = max(r["peak_rss_bytes"] for r in rs) / 2**30
        rd = med(r["read_bytes"] for r in rs) / 2**30
        ok = f"{[r['returncode'] for r in rs]} / {sum(r['new_oom_kills'] for r in rs)}"
        print(f"| {tool} | {tg:.3f} | {pp:.2f} | {per:.0f} | {rss:.2f} | {rd:.1f} | {ok} |")
    for r in runs:
        if r["round"] == 0:
            print(
                f"{r['tool']}: rc {r['returncode']}, wall {r['wall_s']:.1f} s, peak RSS "
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, new OOM kills {r['new_oom_kills']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
