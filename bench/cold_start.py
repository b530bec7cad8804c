#!/usr/bin/env python
"""Cold start, side by side with llama.cpp: disk bandwidth, page-in GB/s, cold `run -n 64` wall, TTFT under a cap.

    python bench/cold_start.py [--model PATH] [--parts disk,pagein,run,llama,ttft] [--cap 8G] [--json OUT]

Every timed part starts from a cold page cache (the model file evicted: bench/cgroup.py's evict, checked
with mincore) and runs as a child process, timed by wall clock:
- disk:   the device's sequential read speed: the first --disk-gib GiB of the file read with O_DIRECT in 16 MiB
          requests, 4 in flight, and the same range read buffered (64 MiB reads after eviction).
- pagein: streamer.pagein.PageIn over every tensor of the file, in forward order (what `stream-run bench`'s
          warm-up and the background page-in of a resident model do): bytes / seconds.
- run:    `stream-run run MODEL -p PROMPT -n 64` wall time (resident: the budget holds the file).
- llama:  llama.cpp without repacking on the same prompt ids (bench/llama_run.py --pp N --tg 64
          --no-repack --no-warmup under /opt/llamavenv/bin/python), wall time.
- ttft:   under a memory cgroup of --cap (root; cgroup v1) with --ram-budget equal to it, `stream-run run
          --tokens IDS -n 1` for 1- and 16-token prompts (bench's fixed random prompt): whole-process wall,
          the first token's time (first_token_s: from the fork to the token, without the session's close and
          the process's teardown after it; 0.2-0.3 s on a 16-token run that faulted in 4 GB of cache), and
          its breakdown (STREAM_RUN_TIMING=1, streamer/timing.py: seconds from the fork to each step of
          the start-up path, when the early page-in of the non-expert weights ended, the expert bytes read
          on demand and by the router lookahead's prefetch, the seconds the forward waited for them).
          Beside it: the bytes the prompt needs (non-expert weights without the embedding table, plus each
          layer's distinct routed experts, from a --trace of the same run) / the disk's sequential GB/s, and
          the target 1.2x that. Never OOM-killed is checked (the cgroup's oom_kill counter).
A model split into shards is given by its first shard (every shard is evicted). --ab OTHER_STREAM_RUN runs
the ttft part alternately with a second build (labelled "(B)"; e.g. a non-editable install of main in another
venv) and prints the ratio of the medians. Use --rounds 2 or 3 for alternating rounds. Results: one JSON line per measurement on stdout (and --json),
then a summary table. Run it on a quiet machine as root, with the project venv's python. On a VM whose kernel hands
freed memory back to the host (free page reporting), --settle S waits before each timed run until that has been idle
for S seconds, so no run pays for the memory the one before it freed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cgroup  # noqa: E402  (bench/cgroup.py: evict, cached_bytes, run_capped)

DEFAULT_MODEL = "/work/models/qwen3-30b-a3b-Q4_K.gguf"
PROMPT = "def fibonacci(n):"
ALL_PARTS = ("disk", "pagein", "run", "llama", "ttft")


def model_files(path: str) -> list[str]:
    """The model's files: path, or every shard of a split model given its first (NAME-0000k-of-0000N.gguf)."""
    import re

    m = re.fullmatch(r"(.*)-00001-of-(\d{5})\.gguf", str(path))
    if not m:
        return [str(path)]
    count = int(m.group(2))
    return [f"{m.group(1)}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]


def cold(path: str) -> int:
    """Evict the model's files (every shard of a split model); the bytes still cached (0 = fully cold)."""
    return sum(cgroup.evict_all(model_files(path)).values())


def _readers_gb_s(fd: int, depth: int, worker, done: list) -> float:
    """Run worker(k) for k < depth in threads; GB/s of the bytes they add to done[k]. Closes fd."""
    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(depth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(done) / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def disk_direct(path: str, nbytes: int, block: int = 16 << 20, depth: int = 4) -> float:
    """GB/s of O_DIRECT reads of [0, nbytes): `depth` threads each reading every depth-th block."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    nbytes = min(nbytes, os.path.getsize(path)) // block * block
    done = [0] * depth

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
        for off in range(k * block, nbytes, depth * block):
            done[k] += os.preadv(fd, [buf], off)

    return _readers_gb_s(fd, depth, worker, done)


def disk_random(path: str, seconds: float = 2.0, block: int = 1 << 20, depth: int = 4) -> float:
    """GB/s of O_DIRECT reads of `block` bytes at random aligned offsets, `depth` threads: what expert reads
    (about 0.9 MB each on the 30B-A3B Q4_K file, scattered) can get at most."""
    import random

    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.path.getsize(path)
    done = [0] * depth
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        buf, rnd = mmap.mmap(-1, block), random.Random(k)
        while time.perf_counter() < stop:
            done[k] += os.preadv(fd, [buf], rnd.randrange(0, size - block) // 4096 * 4096)

    return _readers_gb_s(fd, depth, worker, done)


def disk_buffered(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """GB/s of plain sequential reads of [0, nbytes) through the page cache (evicted first; evicted after)."""
    cold(path)
    buf = bytearray(block)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0, got = time.perf_counter(), 0
        while got < nbytes:
            n = os.preadv(fd, [buf], got)
            if n <= 0:
                break
            got += n
        return got / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        cold(path)


_PAGEIN = r"""
import json, sys, time
from streamer.gguf_file import GGUFFile
from streamer.pagein import PageIn
from streamer.session import forward_order
gf = GGUFFile(sys.argv[1])
p = PageIn(gf.mm, forward_order(gf, [(t.offset, t.nbytes) for t in gf.tensors.values()]), huge=True)  # whole file
p.run()
pmd = sum(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("FilePmdMapped:"))
print(json.dumps({"pagein_bytes": p.done, "pagein_s": p.seconds, "pagein_gb_s": p.gb_s, "pagein_pmd_bytes": pmd}))
"""


class DiskActivity:
    """The model's block device while a run goes on: /sys/dev/block/M:m/stat sampled every `period` seconds
    in a thread (sectors read, requests in flight, io_ticks). summary(t0): seconds from t0 (epoch) to the
    first read, the device's busy seconds (io_ticks) and bytes read from t0 to the end, and the gaps of at
    least `gap` seconds after the first read with nothing in flight (the disk idle while the run waits on
    something else). Other processes' reads count too: run it on a quiet machine."""

    def __init__(self, path: str, period: float = 0.005):
        st = os.stat(path)
        self.file = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
        self.period = period
        self.samples: list[tuple[float, int, int, int]] = []  # (epoch, sectors read, in flight, io_ticks ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        with open(self.file) as f:
            v = f.read().split()
        self.samples.append((time.time(), int(v[2]), int(v[8]), int(v[9])))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period)

    def __enter__(self) -> DiskActivity:
        if os.path.exists(self.file):
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self._sample()

    def summary(self, t0: float, gap: float = 0.02) -> dict:
        s = self.samples
        if len(s) < 2:
            return {}
        first = next((t for (t, n, _, _), (_, n0, _, _) in zip(s[1:], s) if n > n0), None)
        gaps, start = [], None
        for t, _, inflight, _ in s:
            if first is None or t < first:
                continue
            if inflight == 0 and start is None:
                start = t
            elif inflight > 0 and start is not None:
                if t - start >= gap:
                    gaps.append((round(start - t0, 3), round(t - t0, 3)))
                start = None
        out = {
            "disk_first_read_s": None if first is None else round(first - t0, 3),
            "disk_busy_s": (s[-1][3] - s[0][3]) / 1e3,
            "disk_read_bytes": (s[-1][1] - s[0][1]) * 512,
            "disk_idle_gaps": gaps,
            "disk_idle_s": round(sum(b - a for a, b in gaps), 3),
        }
        return out


def timed(
    label: str,
    cmd: list[str],
    path: str,
    cap: str | None = None,
    timeout: float = 900,
    breakdown: bool = False,
    settle: float = 0.0,
) -> dict:
    """Evict `path`, wait for the free page reporting to settle (settle > 0: --settle), run cmd (under a cgroup
    cap if given), return its wall time and counters. breakdown: the command is stream-run's; it also reports its
    start-up timeline (streamer/timing.py), seconds from the moment before it was forked: the result's "timing",
    and the disk's activity meanwhile (DiskActivity)."""
    left = cold(path)
    settled = cgroup.settle(settle) if settle else None
    env, disk = None, None
    if breakdown:
        t0 = time.time()
        env = dict(os.environ, STREAM_RUN_TIMING="1", STREAM_RUN_T0=repr(t0))
        with DiskActivity(path) as disk:
            r = cgroup.run_capped(cmd, cap, timeout=timeout, env=env)
    else:
        r = cgroup.run_capped(cmd, cap, timeout=timeout, env=env)
    out = r.summary()
    if disk is not None:
        out.update(disk.summary(t0))
    out.update(label=label, cached_after_evict=left, stdout_tail=r.stdout[-400:], stderr_tail=r.stderr[-600:])
    if settled is not None:
        out.update(settle_s=round(settled[0], 1), settle_reported_mib=round(settled[1]))
    timing = [line for line in r.stderr.splitlines() if line.startswith("timing: ")]
    if timing:
        out["timing"] = json.loads(timing[-1][len("timing: ") :])
    if r.returncode != 0:
        print(f"warning: {label} exited {r.returncode}: {r.stderr[-400:]}", file=sys.stderr)
    return out


def prompt_ids(model: str, n: int | None, stream_python: str) -> list[int]:
    """n None: the tokens of PROMPT; else the first n of stream-run bench's fixed random prompt."""
    code = (
        "import sys, json\nfrom streamer.gguf_file import GGUFFile\nfrom streamer.config import ModelConfig\n"
        "gf = GGUFFile(sys.argv[1])\n"
        "if sys.argv[2] == 'text':\n"
        "    from streamer.tokenizer import Tokenizer\n"
        "    print(json.dumps(Tokenizer.from_gguf(gf).encode(sys.argv[3])))\n"
        "else:\n"
        "    from streamer.bench import prompt_tokens\n"
        "    print(json.dumps([int(t) for t in prompt_tokens(ModelConfig.from_gguf(gf).n_vocab, int(sys.argv[2]))]))\n"
    )
    arg = "text" if n is None else str(n)
    out = subprocess.run([stream_python, "-c", code, model, arg, PROMPT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def needed_bytes(model: str, ids: list[int], args) -> dict:
    """Bytes a prompt needs: non-expert weights (the embedding table: one row per token) plus each layer's
    distinct routed experts, from a --trace of the same run (routing does not depend on the budget)."""
    code = (
        "import sys, json, numpy as np\nfrom streamer.trace import load_trace\nfrom streamer.gguf_file import GGUFFile\n"
        "gf = GGUFFile(sys.argv[1]); t = load_trace(sys.argv[2]); a = t.a; g = t.geometry\n"
        "rows = t.call_rows(); need = 0\n"
        "for layer in range(g['n_layer']):\n"
        "    ids = set()\n"
        "    for c in np.nonzero((a['c_step'] == 0) & (a['c_layer'] == layer))[0]:\n"
        "        r = slice(rows[c], rows[c + 1])\n"
        "        ids |= set(int(e) for e, w in zip(a['r_ids'][r].ravel(), a['r_wp'][r].ravel()) if w > 0)\n"
        "    need += len(ids) * g['expert_bytes'][layer]\n"
        "e = gf.tensors['token_embd.weight']\n"
        "ne = sum(x.nbytes for x in gf.tensors.values() if '_exps.' not in x.name) - e.nbytes\n"
        "ne += int(sys.argv[3]) * (e.nbytes // e.shape[0])\n"
        "print(json.dumps({'expert_bytes': need, 'nonexpert_bytes': ne, 'needed_bytes': need + ne}))\n"
    )
    with tempfile.TemporaryDirectory(prefix="cold-start-") as d:
        trace = os.path.join(d, "t.npz")
        cmd = ttft_cmd(args, model, ids) + ["--trace", trace]
        subprocess.run(cmd, capture_output=True, check=True, env=run_env())
        out = subprocess.run(
            [args.python, "-c", code, model, trace, str(len(ids))], capture_output=True, text=True, check=True
        )
    return json.loads(out.stdout)


def ttft_record(r: dict, need: dict, n: int, rnd: int, disk_gb_s, random_gb_s) -> dict:
    """A ttft run's record with the bytes the prompt needs, the floor (needed bytes / disk GB/s) and target."""
    rec = {**r, **need, "prompt_tokens": n, "round": rnd}
    if (r.get("timing") or {}).get("first_token") is not None:  # the process's own mark: the token is out, before
        rec["first_token_s"] = r["timing"]["first_token"]  # the session closes and the process is torn down
    if r.get("rusage_read_bytes") and need.get("needed_bytes"):  # disk reads over what the prompt needs
        rec["read_over_needed"] = r["rusage_read_bytes"] / need["needed_bytes"]
    if disk_gb_s:
        rec["floor_s"] = need["needed_bytes"] / disk_gb_s / 1e9
        rec["target_s"] = 1.2 * rec["floor_s"]
    if disk_gb_s and random_gb_s:  # the experts are scattered reads: at the random-read speed
        rec["floor_random_s"] = (need["nonexpert_bytes"] / disk_gb_s + need["expert_bytes"] / random_gb_s) / 1e9
    return rec


def run_env() -> dict:
    env = dict(os.environ)
    env.setdefault("STREAM_RUN_CACHE", tempfile.mkdtemp(prefix="cold-start-cache-"))  # no learned pins
    return env


def ttft_cmd(args, model: str, ids: list[int], exe: str | None = None) -> list[str]:
    return [
        exe or args.stream_run, "run", model, "--tokens", ",".join(map(str, ids)), "-n", "1", "--no-display-prompt",
        "-t", str(args.threads), "-c", "64", "--ram-budget", args.cap,
    ]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma-separated subset of {','.join(ALL_PARTS)}")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of run / llama and of each ttft")
    ap.add_argument("--cap", default="8G", help="cgroup cap and --ram-budget of the ttft runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--disk-gib", type=float, default=4.0, help="GiB read by the disk measurement")
    ap.add_argument("--prompt-tokens", default="1,16", help="prompt sizes of the ttft runs")
    ap.add_argument("--disk-gb-s", type=float, help="the disk's GB/s for the ttft target when 'disk' is not run")
    ap.add_argument("--python", default=sys.executable, help="the project venv's python")
    ap.add_argument(
        "--stream-run", default=shutil.which("stream-run") or str(Path(sys.executable).parent / "stream-run")
    )
    ap.add_argument("--ab", help="ttft: a second stream-run executable, run alternately with --stream-run ('(B)')")
    ap.add_argument(
        "--pause", type=float, default=0.0,
        help="ttft: seconds idle before each run (a VM's host takes back memory freed seconds ago, and a run "
             "that gets memory the last one freed faults it in faster: a pause gives every run the same start)",
    )  # fmt: skip
    ap.add_argument(
        "--settle", type=float, default=0.0, metavar="S",
        help="before each timed run (after evicting the file), wait until the kernel's free page reporting has been "
             "idle for S seconds (bench/cgroup.py's settle: on a VM that hands freed memory back to the host)",
    )  # fmt: skip
    ap.add_argument("--llama-python", default="/opt/llamavenv/bin/python")
    ap.add_argument("--json", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in ALL_PARTS]
    if bad or not os.path.isfile(args.model):
        print(
            f"error: {'unknown parts ' + ','.join(bad) if bad else 'no such model file ' + args.model}", file=sys.stderr
        )
        return 2
    model, results = args.model, []

    def emit(rec: dict) -> None:
        results.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")

    size = os.path.getsize(model)
    disk_gb_s = random_gb_s = None
    if "disk" in parts:
        n = int(args.disk_gib * 2**30)
        cold(model)
        direct = disk_direct(model, n)
        buffered = disk_buffered(model, n)
        random_gb_s = disk_random(model)
        disk_gb_s = max(direct, buffered)
        emit({"label": "disk", "bytes": n, "direct_gb_s": direct, "buffered_gb_s": buffered, "gb_s": disk_gb_s,
              "random_1mib_gb_s": random_gb_s})  # fmt: skip
    elif args.disk_gb_s:
        disk_gb_s = args.disk_gb_s
    if "pagein" in parts:
        r = timed("pagein", [args.python, "-c", _PAGEIN, model], model, settle=args.settle)
        rec = json.loads(r["stdout_tail"].strip().splitlines()[-1]) if r["returncode"] == 0 else {}
        emit({**r, **rec, "file_bytes": size})
    fib = None
    for rnd in range(args.rounds):
        if "run" in parts:
            cmd = [args.stream_run, "run", model, "-p", PROMPT, "-n", str(args.n_predict), "-t", str(args.threads)]
            emit({**timed("stream-run cold run", cmd, model, settle=args.settle), "round": rnd})
        if "llama" in parts:
            fib = fib or prompt_ids(model, None, args.python)
            cmd = [
                args.llama_python, str(HERE / "llama_run.py"), model, "--threads", str(args.threads),
                "--pp", str(len(fib)), "--tg", str(args.n_predict), "--prompt-tokens", ",".join(map(str, fib)),
                "--no-repack", "--no-warmup",
            ]  # fmt: skip
            emit({**timed("llama.cpp no-repack cold run", cmd, model, settle=args.settle), "round": rnd})
    if "ttft" in parts:
        for n in map(int, args.prompt_tokens.split(",")):
            ids = prompt_ids(model, n, args.python)
            need = needed_bytes(model, ids, args)
            runs = [("", args.stream_run)] + ([(" (B)", args.ab)] if args.ab else [])
            for rnd in range(args.rounds):
                for tag, exe in runs if rnd % 2 == 0 else runs[::-1]:  # alternate which goes first
                    cmd = ttft_cmd(args, model, ids, exe)
                    time.sleep(args.pause)
                    r = timed(f"stream-run ttft {n}{tag}", cmd, model, cap=args.cap, breakdown=True, settle=args.settle)
                    emit(ttft_record(r, need, n, rnd, disk_gb_s, random_gb_s))
    print("\nsummary (wall seconds; GB/s):", file=sys.stderr)
    for r in results:
        keys = ("gb_s", "direct_gb_s", "buffered_gb_s", "random_1mib_gb_s", "pagein_gb_s", "pagein_pmd_bytes", "wall_s", "first_token_s",
                "target_s", "floor_random_s", "needed_bytes", "rusage_read_bytes", "read_over_needed", "oom_killed",
                "max_usage_bytes")  # fmt: skip
        print(f"  {r['label']:32s} " + " ".join(f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                                               for k in keys if k in r), file=sys.stderr)  # fmt: skip
        if "timing" in r:
            print("    " + breakdown_line(r["timing"], r.get("wall_s")), file=sys.stderr)
        if r.get("disk_first_read_s") is not None:
            gaps = " ".join(f"{a:.2f}-{b:.2f}" for a, b in r["disk_idle_gaps"]) or "none"
            print(f"    disk: first read at {r['disk_first_read_s']:.2f} s, busy {r['disk_busy_s']:.2f} s, "
                  f"{r['disk_read_bytes'] / 1e9:.2f} GB read; idle {r['disk_idle_s']:.2f} s ({gaps})", file=sys.stderr)  # fmt: skip
    for n in map(int, args.prompt_tokens.split(",")) if "ttft" in parts else ():
        target = [r["target_s"] for r in results if r["label"] == f"stream-run ttft {n}" and "target_s" in r]
        for key, what in (("wall_s", "wall"), ("first_token_s", "first token")):
            a, b = (
                [r[key] for r in results if r["label"] == f"stream-run ttft {n}{tag}" and key in r]
                for tag in ("", " (B)")
            )
            if a and b:
                print(f"  ttft {n}: median {what} {median(a):.3g} s vs (B) {median(b):.3g} s: {median(a) / median(b):.3f}x"
                      f" (A {' '.join(f'{x:.3g}' for x in a)}; B {' '.join(f'{x:.3g}' for x in b)})", file=sys.stderr)  # fmt: skip
            elif a and target:
                print(f"  ttft {n}: median {what} {median(a):.3g} s, target {target[0]:.3g} s"
                      f" ({' '.join(f'{x:.3g}' for x in a)})", file=sys.stderr)  # fmt: skip
    return 0


STEPS = (  # streamer/timing.py's marks, in the order of the start-up path, and what ends at each
    ("header", "interpreter, numpy, GGUF header parsed (the entry point's early start, cli/early.py)"),
    ("pagein_start", "page-in of the non-expert weights started"),
    ("cli", "CLI imports"),
    ("input_checked", "imports of the run command, input checks"),
    ("kernels_imported", "numba + kernel modules imported"),
    ("model_built", "budget plan, expert cache, model objects"),
    ("warmed_up", "kernel warm-up (run: skipped when numba's cache holds them; they load at first call)"),
    ("forward_start", "generator set up: the prompt's forward starts"),
    ("experts_first_read", "first expert read queued (layer 0's routing known)"),
    ("first_token", "forward pass: expert reads + compute"),
    ("closed", "session closed (reader threads joined, learned usage saved)"),
    ("exit", "the command returned; other threads joined (then atexit, flush, the process's teardown)"),
)


def breakdown_line(t: dict, wall: float | None) -> str:
    """The timeline as 'step +seconds' pieces, then the page-in's end and what the forward read."""
    parts, prev = [], 0.0
    for key, _ in STEPS:
        if key in t:
            parts.append(f"{key} +{t[key] - prev:.2f}")
            prev = t[key]
    if wall is not None:
        parts.append(f"end +{wall - prev:.2f}")  # atexit, flush, teardown, reaped
    extra = []
    if "pagein_end" in t:
        extra.append(f"page-in {t.get('pagein_bytes', 0) / 1e9:.2f} GB done at {t['pagein_end']:.2f} s")
    if "kernels_loaded" in t:
        extra.append(f"{len(t['kernels_loaded'])} kernels loaded")
    if "expert_demand_bytes" in t:
        extra.append(
            f"experts read {t['expert_demand_bytes'] / 1e9:.2f} GB on demand + {t['expert_prefetch_bytes'] / 1e9:.2f}"
            f" GB prefetched, forward waited {t['expert_stall_s']:.2f} s for them"
        )
    return " | ".join(parts) + ("\n    " + "; ".join(extra) if extra else "")


if __name__ == "__main__":
    sys.exit(main())
