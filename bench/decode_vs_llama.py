#!/usr/bin/env python
"""Decode (and prefill) speed of stream-run builds side by side with llama.cpp, warm page cache, alternating rounds.

    python3 bench/decode_vs_llama.py /work/models/qwen3-30b-a3b-Q4_K.gguf \\
        --stream-run before=/opt/before/bin/stream-run --stream-run after=/opt/dev/bin/stream-run --rounds 3

Every round runs each variant once, the order reversed every other round: each stream-run build as
`stream-run bench MODEL --pp PP --tg TG -t T --no-stream --json` (all experts resident: the in-RAM case), and
llama.cpp through bench/llama_run.py under --llama-python, with repacking (its fastest decode) unless
--no-repack. The page cache is NOT evicted (a warm in-RAM comparison; read the file once before, e.g. with
`cat MODEL > /dev/null`, and keep enough free RAM). A first round is run and discarded unless --no-discard.
--rewarm reads the model file through the page cache before every run and prints how long that took: llama.cpp's
repacking holds a second copy of the weights in anonymous memory, which on a machine with less than twice the
model's size in RAM pushes part of the file out of the page cache, so without it the run after llama.cpp's
pages the file back in while it is timed (seen on the 17 GB 30B-A3B file on a 24 GiB machine: decode 9.8 vs
14.6 tok/s for the same build).
--fresh drops the file from the page cache (posix_fadvise DONTNEED) and reads it back before every run, so
every run starts from the same cache, all of it in 2 MiB folios (--rewarm reads back only what llama.cpp's
run pushed out, and Linux may hold that in small folios: 10.0 of 17.4 GB in 2 MiB folios once). It does not
favour stream-run: on this KVM guest its runs were slower after a fresh read (bench/RESULTS.md, twelfth
session), so --rewarm stays the protocol. Both print the read's seconds and the page cache's 2 MiB folios
(FileHugePages) after it.
--settle S waits, after any re-read and before every run, until the guest kernel's free page reporting has been idle
for S seconds: on a VM whose kernel reports freed memory to the host, the 17 GB llama.cpp frees at exit is reported
for 20-25 s afterwards, and a run during that suffers CPU steal and stalled steps (a mapped file's decode most, the
anonymous copies of --no-mmap and llama.cpp's repacking hardly: they leave the kernel little free memory to report).
--read PYTHON runs bench/decode_roofline.py --read-only under PYTHON (one with numba and stream-run installed)
right after every timed run: the one-region read of 16 decode steps' weight bytes, so each decode is paired with
the memory bandwidth of its moment (on the KVM guest of the sixth to twelfth sessions it flips between ~30 and
~50 GB/s within a minute). Each run then also prints its decode as a share of that read (tok/s x bytes per
token / read GB/s), and the summary splits the rounds at --slow-gb-s: where the read is slow every decoder of
the same bytes is near memory-bound, and the ratio between them is bounded by their shares of the read. Measured
on 2026-12-02 (bench/RESULTS.md): over 28 runs of each engine the read after a run did not predict
its decode (correlation 0.14 for stream-run, -0.05 for llama.cpp), so the split says little on this VM; the
per-run step spread (stream-run's) and steal are the other clues printed.
Every run also prints its CPU steal (/proc/stat: the share of the vCPUs' time the hypervisor gave to others) and,
its decode steps' min / median / p90 / max ms (`stream-run bench`'s tg_step_ms; llama_run.py times each step the
same way).
--state NAME (repeatable) puts the machine in a state before every timed run, and the summary gives each state's
medians and ratios apart, then each variant's spread between states (the slowest state's median against the
fastest's): `warm` nothing; `after-dense` runs the first build's bench on --dense (a small dense file) first;
`after-llama` runs llama.cpp on the model first (untimed: its freed memory is what the next run meets);
`settled` does that, then waits until the kernel's free page reporting has been idle for 3 s.
Every run's line ends with the machine's record over it (streamer/machine.py, standard library only): memory
free before it, page faults (major), CPU steal and MiB reported to the host during it; the machine line (CPU,
its ISA and the kernels' if NUMBA_CPU_FEATURES is set, THP, free page reporting) heads the output. To time
the AVX2 paths on an AVX-512 CPU, give a build as "env NUMBA_CPU_NAME=... NUMBA_CPU_FEATURES=... stream-run".
Prints every run's prefill / decode tok/s, the medians, and each stream-run build's median decode ratio against
llama.cpp and against the first build. Only the standard library (and bench/cgroup.py, streamer/machine.py,
which are too): runs under any Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import cgroup  # noqa: E402  (bench/cgroup.py: settle)

from streamer import machine  # noqa: E402  (standard library only)

HERE = Path(__file__).resolve().parent
STATES = ("warm", "after-dense", "after-llama", "settled")


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _run_json(cmd: list[str], what: str) -> dict:
    """Run cmd (from /tmp) and return the last JSON line of its output; RuntimeError naming `what` if it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")
    if p.returncode:
        raise RuntimeError(f"{what}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
    return _last_json(p.stdout)


def stream_cmd(exe: str) -> tuple[list[str], list[str]]:
    """exe's words split at the stream-run executable: (prefix up to and including it, bench flags after it).
    exe: "PATH --no-mmap", or "env VAR=VALUE ... PATH --flags"."""
    words = shlex.split(exe)
    i = 0
    if words[0] == "env":
        i = 1
        while i < len(words) and "=" in words[i]:
            i += 1
    return words[: i + 1], words[i + 1 :]


def run_stream(exe: str, a, model: str | None = None, pp: int | None = None, tg: int | None = None):
    """exe: a stream-run executable, then any flags of its bench (shell words: "PATH --no-mmap")."""
    head, flags = stream_cmd(exe)
    cmd = head + ["bench", model or a.model, "--pp", str(pp or a.pp), "--tg", str(tg or a.tg), "-t", str(a.threads)]
    cmd += ["--no-stream", "--json"] + flags
    r = _run_json(cmd, " ".join(cmd))
    # stream-run bench's decode steps (min, median, p90, max ms), where it reports them
    return r["pp_tok_s"], r["tg_tok_s"], r.get("tg_step_ms")


def rewarm(path: str, drop: bool = False) -> float:
    """Read the file through the page cache (as `cat FILE > /dev/null`), first dropping it from the cache if
    drop; seconds taken."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        if drop:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def file_huge_gb() -> float:
    """The page cache's bytes in 2 MiB folios (FileHugePages), GB; nan where /proc/meminfo has no such line."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("FileHugePages:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def read_after(a) -> tuple[float, int]:
    """(read GB/s, weight bytes per decode step) of decode_roofline.py --read-only 16, under a.read."""
    r = _run_json(
        [a.read, str(HERE / "decode_roofline.py"), a.model, "--read-only", "16"], "decode_roofline.py --read-only"
    )
    return r["read_gb_s"], r["bytes_per_token"]


def prepare(state: str, a, first_build: str) -> str:
    """Put the machine in `state` (STATES) before a timed run; what was done, for the run's line."""
    if state == "after-dense":
        run_stream(first_build, a, model=a.dense, pp=32, tg=8)
        return "after a dense run"
    if state in ("after-llama", "settled"):
        run_llama(a)
        if state == "after-llama":
            return "right after llama.cpp"
        waited, mib = cgroup.settle(3.0)
        return f"after llama.cpp + {waited:.0f} s until reporting idle ({mib:.0f} MiB)"
    return "warm"


def record(before: dict) -> str:
    """The machine over a run: memory free at its start, page faults, CPU steal, memory reported to the host."""
    d = machine.during(before)
    free = before["memory"].get("MemFree", 0) / 2**30
    out = f"  [free {free:4.1f} GiB, faults {d.get('pgfault', 0)} ({d.get('pgmajfault', 0)} major)"
    out += f", steal {100 * d.get('steal_share', 0):.1f}%"
    return out + (f", reported {d['reported_mib']:.0f} MiB]" if "reported_mib" in d else "]")


def run_llama(a) -> tuple[float, float, dict | None]:
    cmd = [a.llama_python, str(HERE / "llama_run.py"), a.model, "--threads", str(a.threads), "--pp", str(a.pp)]
    cmd += ["--tg", str(a.tg)] + (["--no-repack"] if a.no_repack else [])
    r = _run_json(cmd, "llama_run.py")
    return r["pp_tok_s"], r["tg_tok_s"], r.get("tg_step_ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument(
        "--stream-run",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a stream-run executable to time, optionally with flags for its bench, as one argument "
        "(main='/opt/dev/bin/stream-run --no-mmap'; repeatable; the first is the baseline)",
    )
    ap.add_argument("--llama-python", default="/opt/llamavenv/bin/python")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp without repacking")
    ap.add_argument("--pp", type=int, default=32)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-discard", action="store_true", help="keep the first round")
    ap.add_argument("--rewarm", action="store_true", help="read the model into the page cache before every run")
    ap.add_argument(
        "--fresh", action="store_true", help="drop the model from the page cache and read it back before every run"
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=0,
        metavar="S",
        help="before every run, wait until the kernel's free page reporting has been idle for S seconds (at most "
        "3 minutes; nothing where the kernel has no such counter: bench/cgroup.py's settle)",
    )
    ap.add_argument("--read", metavar="PYTHON", help="after every run, time a read of the step's bytes under PYTHON")
    ap.add_argument("--slow-gb-s", type=float, default=36.0, help="--read: reads below this are the slow phase")
    ap.add_argument("--state", action="append", choices=STATES, help="the machine's state before every run")
    ap.add_argument("--dense", help="--state after-dense: the small dense file run before")
    a = ap.parse_args(argv)
    a.state = a.state or ["warm"]
    if "after-dense" in a.state and not (a.dense and Path(a.dense).is_file()):
        print("error: --state after-dense needs --dense FILE (a small dense model)", file=sys.stderr)
        return 2
    if a.no_llama and {"after-llama", "settled"} & set(a.state):
        print("error: --state after-llama/settled runs llama.cpp: drop --no-llama", file=sys.stderr)
        return 2
    builds = []
    for s in a.stream_run:
        name, sep, path = s.partition("=")
        if not sep or not name or not path.strip():
            print(f"error: --stream-run wants NAME=PATH, got {s!r}", file=sys.stderr)
            return 2
        exe = stream_cmd(path)[0][-1]
        if not shutil.which(exe):
            print(f"error: --stream-run {name}: no such executable: {exe}", file=sys.stderr)
            return 2
        builds.append((name, path))
    if not builds:
        print("error: give at least one --stream-run NAME=PATH", file=sys.stderr)
        return 2
    if not a.no_llama and not shutil.which(a.llama_python):
        print(f"error: --llama-python wants a Python with llama-cpp-python, got {a.llama_python!r}", file=sys.stderr)
        return 2
    if a.read and not shutil.which(a.read):
        print(f"error: --read wants a Python with stream-run installed, got {a.read!r}", file=sys.stderr)
        return 2
    if not Path(a.model).is_file():
        print(f"error: no such model file: {a.model}", file=sys.stderr)
        return 2
    variants = [(n, lambda p=p: run_stream(p, a)) for n, p in builds]
    llama = "llama.cpp" + (" (no repack)" if a.no_repack else " (repack)")
    if not a.no_llama:
        variants.append((llama, lambda: run_llama(a)))
    print("machine: " + machine.line(machine.describe()), flush=True)
    if not a.no_llama:
        info = "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
        p = subprocess.run([a.llama_python, "-c", info], capture_output=True, text=True)
        print("llama.cpp: llama-cpp-python " + (p.stdout.strip().splitlines() or ["?"])[-1], flush=True)
    base = builds[0][0]
    by_state = {}
    for state in a.state:
        res, reads = run_rounds(a, variants, state, builds[0][1])
        med = {n: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v)) for n, v in res.items()}
        by_state[state] = med
        print(
            f"\nmedians of {a.rounds} rounds, {state} ({Path(a.model).name}, pp {a.pp}, tg {a.tg}, {a.threads} threads):"
        )
        for n, (pp, tg) in med.items():
            line = f"  {n:24s} prefill {pp:8.2f}  decode {tg:7.2f} tok/s"
            if n != llama:
                if n != base:
                    line += f"  decode {tg / med[base][1]:.3f}x {base}"
                if llama in med:
                    line += f"  decode {tg / med[llama][1]:.3f}x / prefill {pp / med[llama][0]:.3f}x {llama}"
            print(line)
        if a.read:
            print_phases(res, reads, a.slow_gb_s, llama if llama in res else None)
    if len(by_state) > 1:
        print("\nspread between states (fastest state's median / slowest's):")
        for n, _ in variants:
            pps = [m[n][0] for m in by_state.values()]
            tgs = [m[n][1] for m in by_state.values()]
            print(f"  {n:24s} prefill {max(pps) / min(pps):.2f}x  decode {max(tgs) / min(tgs):.2f}x")
    return 0


def run_rounds(a, variants, state: str, first_build: str):
    """a.rounds (plus a discarded first) of every variant in `state`, alternating the order: ({variant: [(pp,
    tg)]}, {variant: [(read GB/s, decode's share of it)]})."""
    res: dict[str, list[tuple[float, float]]] = {n: [] for n, _ in variants}
    reads: dict[str, list[tuple[float, float]]] = {n: [] for n, _ in variants}
    total = a.rounds + (0 if a.no_discard else 1)
    for r in range(total):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, fn in order:
            if a.rewarm or a.fresh:
                took = rewarm(a.model, drop=a.fresh)
                what = "dropped and read" if a.fresh else "re-read"
                print(f"  page cache {what} in {took:.1f} s, {file_huge_gb():.1f} GB in 2 MiB folios", flush=True)
            if a.settle:
                waited, mib = cgroup.settle(a.settle)
                print(f"  free page reporting idle after {waited:.1f} s ({mib:.0f} MiB reported meanwhile)", flush=True)
            how = prepare(state, a, first_build)
            before = machine.describe()
            pp, tg, steps = fn()
            keep = a.no_discard or r > 0
            line = f"round {r}{'' if keep else ' (discarded)'}: {name:24s} prefill {pp:8.2f}  decode {tg:7.2f} tok/s"
            if steps:
                line += "  steps {min:.1f} / {median:.1f} / {p90:.1f} / {max:.1f} ms".format(**steps)
            if a.read:
                gbs, per_tok = read_after(a)
                share = tg * per_tok / 1e9 / gbs
                line += f"  read after {gbs:5.1f} GB/s, decode at {100 * share:3.0f}% of it"
                if keep:
                    reads[name].append((gbs, share))
            print(line + record(before) + f" ({how})", flush=True)
            if keep:
                res[name].append((pp, tg))
    return res, reads


def print_phases(res, reads, slow: float, llama) -> None:
    """Per variant and phase (read < slow GB/s, or not): runs, median read, median decode and its share of the
    read, and the decode's ratio to llama.cpp's median in the same phase."""
    print(f"\ndecode beside the read after it (slow phase: read < {slow:g} GB/s):")
    rows = {}
    for n in res:
        for (_, tg), (gbs, sh) in zip(res[n], reads[n]):
            rows.setdefault((n, "slow" if gbs < slow else "fast"), []).append((tg, gbs, sh))
    med = {k: [statistics.median(c) for c in zip(*v)] for k, v in rows.items()}
    for (n, phase), (tg, gbs, sh) in med.items():
        line = f"  {n:24s} {phase}: {len(rows[n, phase]):2d} runs, read {gbs:5.1f} GB/s, decode {tg:6.2f} tok/s"
        line += f" = {100 * sh:3.0f}% of it"
        if llama and n != llama and (llama, phase) in med:
            line += f"  {tg / med[llama, phase][0]:.3f}x {llama}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
