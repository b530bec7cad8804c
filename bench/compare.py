#!/usr/bin/env python
"""stream-run vs llama.cpp on the same GGUF files (issue 6): speed, disk reads, memory, logits agreement.

    /opt/dev/bin/python bench/compare.py                      # the issue-6 workloads (writes /work/models/*)
    /opt/dev/bin/python bench/compare.py -w dense-q8 -w dense-q4k --runs 3
    /opt/dev/bin/python bench/compare.py -w smoke-dense -w smoke-moe -w smoke-cap --out /tmp/RESULTS.md
    /opt/dev/bin/python bench/compare.py --list               # workloads and what they run
    /opt/dev/bin/python bench/compare.py -w moe-cap8 --dry-run  # print the commands only

Protocol, per workload: the model is written once with `stream-run synth` (fixed seed, untied head, the
real Qwen3 vocabulary for real-geometry presets) into --models-dir. Then --runs rounds; in each round every
variant (llama.cpp with repacking, llama.cpp without, stream-run) runs once, the order alternating between
rounds. Before every run the model file is evicted from the page cache (posix_fadvise DONTNEED, checked
with mincore); capped workloads run inside a fresh cgroup-v1 memory cgroup whose limit counts page cache.
Every child is measured from outside the same way (wait4 rusage: peak RSS, bytes read from storage; see
bench/cgroup.py), beside what each tool reports itself. Then, for workloads that check parity, both tools
compute per-position logits for the same tokens under teacher forcing and we report cosine and top-1.

stream-run is timed with `stream-run bench --json` when that command exists, else by parsing the summary
line of `stream-run run --tokens ... -n TG` (marked "fallback" in the results: it has no warm-up, so its
prefill includes first-touch page-ins). llama.cpp runs in bench/llama_run.py under --llama-python.
Results: a ratio table on stdout and --out (default bench/RESULTS.md) with date, machine, commands and raw
figures. Never run in CI; needs root for the cgroup and for a fair page-cache eviction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import cgroup  # noqa: E402  (bench/cgroup.py)

from streamer import machine as machine_state  # noqa: E402  (standard library only)

ROOT = Path(__file__).resolve().parent.parent
LLAMA_RUN = Path(__file__).resolve().parent / "llama_run.py"


@dataclass(frozen=True)
class Workload:
    preset: str
    qtype: str
    pp: int
    tg: int
    about: str
    cap: str | None = None  # cgroup memory cap (page cache included)
    logits: bool = True  # also compare per-position logits under teacher forcing
    ttft: bool = False  # time to first token: whole-process wall time of a 1-token run
    vocab: str = "real"
    targets: dict = field(default_factory=dict)  # metric -> (ratio or absolute, text)


WORKLOADS: dict[str, Workload] = {
    "dense-q8": Workload(
        "qwen3-0.6b",
        "Q8_0",
        128,
        64,
        "dense Qwen3-0.6B geometry, Q8_0, untied",
        targets={"tg_tok_s": (0.8, "decode >= 0.8x (aim 1.0x)"), "pp_tok_s": (0.5, "prefill >= 0.5x")},
    ),
    "dense-q4k": Workload(
        "qwen3-0.6b",
        "Q4_K",
        128,
        64,
        "same, Q4_K",
        targets={"tg_tok_s": (0.8, "decode >= 0.8x (aim 1.0x)"), "pp_tok_s": (0.5, "prefill >= 0.5x")},
    ),
    "moe-ram": Workload(
        "qwen3-30b-a3b",
        "Q4_K",
        128,
        64,
        "MoE 30B-A3B geometry Q4_K (17 GB), all in RAM",
        targets={"tg_tok_s": (0.7, "decode >= 0.7x of llama.cpp (13.7 tok/s)")},
    ),
    "moe-cap8": Workload(
        "qwen3-30b-a3b",
        "Q4_K",
        16,
        24,
        "same file, 8 GB cgroup cap",
        cap="8G",
        logits=False,
        targets={
            "tg_tok_s": ("abs", 1.5, "decode >= 1.5 tok/s, never OOM-killed, disk reads <= 1.1x missed-expert bytes")
        },
    ),
    "ttft": Workload(
        "qwen3-30b-a3b",
        "Q4_K",
        16,
        1,
        "time to first token on the 17 GB file, JIT cache warm",
        logits=False,
        ttft=True,
        targets={"wall_s": ("abs_max", 3.0, "<= 3 s")},
    ),
    # smoke workloads: seconds, to check the harness end to end
    "smoke-dense": Workload("tiny", "Q8_0", 32, 16, "SMOKE: tiny dense Q8_0 (byte vocab)", vocab="bytes"),
    "smoke-moe": Workload("tiny-moe", "Q8_0", 32, 16, "SMOKE: tiny MoE Q8_0 (byte vocab)", vocab="bytes"),
    "smoke-cap": Workload(
        "tiny-moe", "Q8_0", 16, 8, "SMOKE: tiny MoE under a 1 GB cap", cap="1G", logits=False, vocab="bytes"
    ),
    "smoke-ttft": Workload(
        "tiny", "Q8_0", 16, 1, "SMOKE: tiny dense time to first token", logits=False, ttft=True, vocab="bytes"
    ),
}
DEFAULT_WORKLOADS = ["dense-q8", "dense-q4k", "moe-ram", "moe-cap8", "ttft"]


# ---------------------------------------------------------------- models and prompts
def model_path(models_dir: Path, w: Workload) -> Path:
    return models_dir / f"{w.preset}-{w.qtype}{'-bytes' if w.vocab == 'bytes' else ''}.gguf"


def ensure_model(args, w: Workload) -> Path:
    path = model_path(args.models_dir, w)
    if not path.exists():
        cmd = [
            args.stream_run,
            "synth",
            str(path),
            "--preset",
            w.preset,
            "--qtype",
            w.qtype,
            "--vocab",
            w.vocab,
            "--seed",
            "0",
        ]
        print("+ " + shlex.join(cmd), file=sys.stderr)
        if not args.dry_run:
            args.models_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run(cmd, check=True)
    return path


def n_vocab_of(path: Path) -> int:
    """Rows of token_embd, read in a child process: a mapping of the file left alive in this process would
    keep its pages in the page cache (posix_fadvise DONTNEED does not drop mapped pages)."""
    code = (
        "import sys; from streamer.gguf_file import GGUFFile; "
        "print(GGUFFile(sys.argv[1]).tensors['token_embd.weight'].shape[0])"
    )
    return int(
        subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()
    )


def bench_prompt(n_vocab: int, pp: int) -> list[int]:
    """The prompt `stream-run bench` uses, so both tools prefill the same ids."""
    try:
        from streamer.bench import prompt_tokens
    except ImportError:
        return np.random.default_rng(1234).integers(0, n_vocab, size=pp, dtype=np.int64).tolist()
    return [int(t) for t in prompt_tokens(n_vocab, pp)]


# ---------------------------------------------------------------- commands
def stream_run_has_bench(stream_run: str) -> bool:
    p = subprocess.run([stream_run, "bench", "--help"], capture_output=True, text=True)
    return p.returncode == 0 and "--json" in p.stdout


def sr_budget(args, w: Workload) -> str | None:
    if args.sr_budget:
        return args.sr_budget
    if w.cap:  # the promise: a cgroup cap equal to --ram-budget is never exceeded
        cap = cgroup.parse_size(w.cap)
        return str(cap - cgroup.parse_size(args.budget_margin))
    return None


def variants(args, w: Workload, path: Path, prompt: list[int], has_bench: bool) -> list[tuple[str, list[str]]]:
    """(label, argv) of every timed run of this workload."""
    out = []
    for repack in (True, False):
        if not repack and args.skip_no_repack:
            continue
        cmd = [
            args.llama_python,
            str(LLAMA_RUN),
            str(path),
            "--threads",
            str(args.threads),
            "--pp",
            str(w.pp),
            "--tg",
            str(w.tg),
            "--prompt-tokens",
            ",".join(map(str, prompt)),
        ]
        if not repack:
            cmd.append("--no-repack")
        if w.ttft:
            cmd.append("--no-warmup")
        cmd += shlex.split(args.llama_args)
        out.append(("llama.cpp" if repack else "llama.cpp no-repack", cmd))
    budget = sr_budget(args, w)
    extra = (["--ram-budget", budget] if budget else []) + shlex.split(args.sr_args)
    if has_bench and not w.ttft:
        cmd = [
            args.stream_run,
            "bench",
            str(path),
            "--pp",
            str(w.pp),
            "--tg",
            str(w.tg),
            "--json",
            "-t",
            str(args.threads),
            *extra,
        ]
        out.append(("stream-run", cmd))
    else:  # ttft, or no bench command yet: a plain run, timed by its own summary line and by wall time
        cmd = [
            args.stream_run,
            "run",
            str(path),
            "--tokens",
            ",".join(map(str, prompt)),
            "-n",
            str(w.tg),
            "--no-display-prompt",
            "-t",
            str(args.threads),
            "-c",
            str(w.pp + w.tg + 16),
            *extra,
        ]
        out.append(("stream-run" if w.ttft else "stream-run (fallback)", cmd))
    return out


_SUMMARY = re.compile(
    r"prompt: (\d+) tok in ([\d.]+) s \(([\d.]+) tok/s\) \| generation: (\d+) tok in ([\d.]+) s "
    r"\(([\d.]+) tok/s\)"
)


def parse_tool_output(label: str, stdout: str, stderr: str) -> dict:
    """The tool's own report: the last JSON line on stdout, or (stream-run run) the stderr summary line."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    m = _SUMMARY.search(stderr)
    if m and label.startswith("stream-run"):
        pt, ps, pr, gt, gs, gr = m.groups()
        return {
            "pp_tok_s": float(pr),
            "tg_tok_s": float(gr) if int(gt) else None,
            "pp": int(pt),
            "tg_decode_steps": int(gt),
            "source": "run summary line",
            "tokens_text": stdout.strip()[:200],
        }
    return {}


def short_cmd(cmd: list[str]) -> str:
    """The command line with long token lists abbreviated."""
    return " ".join(shlex.quote(c if len(c) < 80 else c[:40] + "...") for c in cmd)


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def run_one(args, w: Workload, path: Path, label: str, cmd: list[str], rnd: int) -> dict:
    left = cgroup.evict_all([path])[str(path)] if path.exists() else None
    rec = {
        "label": label,
        "round": rnd,
        "cmd": shlex.join(cmd),
        "cap": w.cap,
        "loadavg_before": loadavg(),
        "cached_after_evict": left,
    }
    print(f"  [{rnd}] {label}: {short_cmd(cmd)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return rec
    r = cgroup.run_capped(cmd, w.cap, timeout=args.timeout)
    rec.update(r.summary())
    rec.pop("cmd", None)
    rec["cmd"] = shlex.join(cmd)
    rec["tool"] = parse_tool_output(label, r.stdout, r.stderr)
    if not args.keep_logs:
        rec["tool"].pop("load_log", None)
    if r.returncode != 0:
        rec["stderr_tail"] = r.stderr[-2000:]
    status = "OOM-killed" if r.oom_killed else (r.killed_by_signal or f"rc={r.returncode}")
    t = rec["tool"]
    print(
        f"      {status}  wall {r.wall_s:.1f} s  pp {fmt(t.get('pp_tok_s'))}  tg {fmt(t.get('tg_tok_s'))} tok/s  "
        f"read {r.rusage_read_bytes / 2**20:.0f} MiB  peak RSS {r.rusage_maxrss_bytes / 2**20:.0f} MiB"
        + (f"  cgroup max {r.max_usage_bytes / 2**20:.0f} MiB" if w.cap else ""),
        file=sys.stderr,
        flush=True,
    )
    return rec


# ---------------------------------------------------------------- logits agreement
def logits_agreement(args, w: Workload, path: Path, tokens: list[int]) -> dict:
    ids = ",".join(map(str, tokens))
    with tempfile.TemporaryDirectory() as d:
        lf, sf = os.path.join(d, "llama.npy"), os.path.join(d, "sr.npy")
        cmds = {
            "llama.cpp": [
                args.llama_python,
                str(LLAMA_RUN),
                str(path),
                "--threads",
                str(args.threads),
                "--logits-tokens",
                ids,
                "--logits-out",
                lf,
            ],
            "stream-run": [
                args.stream_run,
                "run",
                str(path),
                "--tokens",
                ids,
                "--logits-out",
                sf,
                "-t",
                str(args.threads),
                "-c",
                str(len(tokens) + 16),
            ],
        }
        out = {"n_tokens": len(tokens), "commands": {k: shlex.join(v) for k, v in cmds.items()}}
        if args.dry_run:
            return out
        for k, c in cmds.items():
            p = subprocess.run(c, capture_output=True, text=True, timeout=args.timeout)
            if p.returncode != 0:
                out["error"] = f"{k} failed (rc {p.returncode}): {p.stderr[-800:]}"
                return out
        a, b = np.load(sf).astype(np.float64), np.load(lf).astype(np.float64)
    if a.shape != b.shape:
        out["error"] = f"shape mismatch: stream-run {a.shape} vs llama.cpp {b.shape}"
        return out
    cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    out.update(
        cos_min=float(cos.min()),
        cos_median=float(np.median(cos)),
        cos_mean=float(cos.mean()),
        frac_cos_ge_0999=float((cos >= 0.999).mean()),
        top1=float((a.argmax(1) == b.argmax(1)).mean()),
        norm_ratio_max_dev=float(np.abs(np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1) - 1).max()),
        cos_per_position=[round(float(c), 6) for c in cos],
    )
    return out


# ---------------------------------------------------------------- report
def fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if unit == "%":
        return f"{100 * v:.1f}%"
    if unit == "B":
        return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def median(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict]) -> dict[str, dict]:
    """label -> median figures over the rounds (only successful runs count; failures are listed)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r)
    out = {}
    for label, rs in by.items():
        ok = [r for r in rs if r.get("returncode") == 0]
        tools = [r.get("tool", {}) for r in ok]
        pp_tg_reads = []
        for t in tools:
            if "read_bytes_pp" in t:
                pp_tg_reads.append(t["read_bytes_pp"] + t["read_bytes_tg"])
            elif "disk_read_bytes" in t and t.get("source") is None:
                pp_tg_reads.append(t["disk_read_bytes"])
        out[label] = {
            "n_ok": len(ok),
            "n": len(rs),
            "failures": [
                ("OOM-killed" if r.get("oom_killed") else r.get("killed_by_signal") or f"rc={r.get('returncode')}")
                for r in rs
                if r.get("returncode") != 0
            ],
            "pp_tok_s": median([t.get("pp_tok_s") for t in tools]),
            "tg_tok_s": median([t.get("tg_tok_s") for t in tools]),
            "wall_s": median([r.get("wall_s") for r in ok]),
            "read_bytes": median([r.get("rusage_read_bytes") for r in ok]),
            "read_bytes_pp_tg": median(pp_tg_reads),
            "peak_rss": median([r.get("rusage_maxrss_bytes") for r in ok]),
            "cgroup_max": median([r.get("max_usage_bytes") for r in ok]) if any(r.get("cap") for r in rs) else None,
            "ttft_self": median([t.get("ttft_s") for t in tools]),
            "hit_rate": median([t.get("expert_hit_rate") for t in tools]),
            "read_per_token": median([t.get("read_bytes_per_token") for t in tools]),
            "recall": median([t.get("prefetch_recall") for t in tools]),
            # stream-run: storage reads over the expert bytes its cache asked for (issue 6: <= 1.1 under a cap)
            "disk_over_requested": median(
                [
                    t["disk_read_bytes"] / req
                    for t in tools
                    if (
                        req := (t.get("prefill_read_bytes") or 0)
                        + (t.get("read_bytes_per_token") or 0) * max(t.get("tg", 1) - 1, 0)
                    )
                    > 0
                    and "disk_read_bytes" in t
                ]
            ),
            "tokens": tools[0].get("tokens") if tools else None,
        }
    return out


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def workload_table(name: str, w: Workload, summ: dict[str, dict], agree: dict | None) -> str:
    labels = list(summ)
    sr = next((l for l in labels if l.startswith("stream-run")), None)
    ll = [l for l in labels if l.startswith("llama.cpp")]
    rows = [
        ("prefill tok/s", "pp_tok_s", ""),
        ("decode tok/s", "tg_tok_s", ""),
        ("process wall s", "wall_s", ""),
        ("disk read, whole process", "read_bytes", "B"),
        ("disk read, prefill + decode (tool)", "read_bytes_pp_tg", "B"),
        ("peak RSS", "peak_rss", "B"),
    ]
    if w.cap:
        rows.append(("cgroup max usage", "cgroup_max", "B"))
    if w.ttft:
        rows.append(("ttft, self-reported s", "ttft_self", ""))
    if w.preset.endswith("moe") or w.preset.startswith("qwen3-30b") or w.preset.startswith("qwen3-235b"):
        rows += [
            ("expert hit rate (random router)", "hit_rate", "%"),
            ("read bytes / decoded token", "read_per_token", "B"),
            ("prefetch recall", "recall", "%"),
            ("disk read / expert bytes requested", "disk_over_requested", ""),
        ]
    head = ["metric", *labels] + [f"stream-run / {l}" for l in ll if sr]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title, key, unit in rows:
        cells = [fmt(summ[l].get(key), unit) for l in labels]
        rat = (
            [
                fmt(ratio(summ[sr].get(key), summ[l].get(key))) + "x"
                if sr and ratio(summ[sr].get(key), summ[l].get(key))
                else "-"
                for l in ll
            ]
            if sr
            else []
        )
        lines.append("| " + " | ".join([title, *cells, *rat]) + " |")
    fails = {l: s["failures"] for l, s in summ.items() if s["failures"]}
    lines.append(
        "| runs ok | "
        + " | ".join(f"{summ[l]['n_ok']}/{summ[l]['n']}" for l in labels)
        + " |"
        + " |" * len(ll if sr else [])
    )
    text = "\n".join(lines)
    if fails:
        text += "\n\nFailed runs: " + "; ".join(f"{l}: {', '.join(f)}" for l, f in fails.items())
    if sr and ll and summ[sr].get("tokens") and summ[ll[0]].get("tokens"):
        a, b = summ[sr]["tokens"], summ[ll[0]]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        text += (
            f"\n\nGreedy tokens: the first {same} of {min(len(a), len(b))} agree between stream-run and "
            f"{ll[0]} (free-running; a near-tie flips the rest, so this is informative only)."
        )
    if agree:
        if "error" in agree:
            text += f"\n\nLogits agreement: ERROR {agree['error']}"
        elif "cos_min" in agree:
            text += (
                f"\n\nLogits agreement (teacher forcing, {agree['n_tokens']} positions, stream-run vs llama.cpp): "
                f"cosine min {agree['cos_min']:.5f}, median {agree['cos_median']:.5f}, "
                f"{100 * agree['frac_cos_ge_0999']:.0f}% of positions >= 0.999; top-1 agreement "
                f"{100 * agree['top1']:.1f}%; max |norm ratio - 1| {agree['norm_ratio_max_dev']:.4f}."
            )
    return text


def targets_line(name: str, w: Workload, summ: dict[str, dict]) -> str | None:
    sr = next((l for l in summ if l.startswith("stream-run")), None)
    ref = summ.get("llama.cpp")
    if not sr or not w.targets:
        return None
    bits = []
    for key, t in w.targets.items():
        got = summ[sr].get(key)
        if t[0] == "abs":
            bits.append(f"{t[2]}: {fmt(got)} -> {'MET' if got is not None and got >= t[1] else 'MISSED'}")
        elif t[0] == "abs_max":
            bits.append(f"{t[2]}: {fmt(got)} s -> {'MET' if got is not None and got <= t[1] else 'MISSED'}")
        else:
            r = ratio(got, ref.get(key)) if ref else None
            bits.append(f"{t[1]}: {fmt(r)}x -> {'MET' if r is not None and r >= t[0] else 'MISSED'}")
    if w.cap:
        bits.append(f"disk read / expert bytes requested {fmt(summ[sr].get('disk_over_requested'))} (want <= 1.1)")
    if summ[sr]["failures"]:
        bits.append(f"stream-run failures: {', '.join(summ[sr]['failures'])}")
    return "; ".join(bits)


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, shell=True).stdout.strip()
        except OSError:
            return "?"

    mem = sh("awk '/MemTotal/ {print $2}' /proc/meminfo")
    return {
        "cpu": sh("lscpu | sed -n 's/^Model name:[[:space:]]*//p'"),
        "cores": os.cpu_count(),
        "ram": f"{int(mem) / 2**20:.1f} GiB" if mem.isdigit() else "?",
        "kernel": platform.release(),
        "state": machine_state.line(machine_state.describe()),  # ISA, memory, THP, free page reporting
        "disk": sh(f"df -h --output=source,fstype,size {shlex.quote(str(ROOT))} | tail -1"),
        "stream_run_commit": sh(f"git -C {shlex.quote(str(ROOT))} rev-parse --short HEAD")
        + (" (dirty tree)" if sh(f"git -C {shlex.quote(str(ROOT))} status --porcelain --untracked-files=no") else ""),
    }


def llama_versions(args) -> dict:
    p = subprocess.run(
        [
            args.llama_python,
            "-c",
            "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_version().decode(), "
            "llama_cpp.llama_print_system_info().decode().strip())",
        ],
        capture_output=True,
        text=True,
    )
    return {"llama_cpp_python / llama.cpp": p.stdout.strip() or p.stderr.strip()[-200:]}


def write_report(args, results: list[dict], out: Path) -> str:
    smoke = any(r["workload"].startswith("smoke") for r in results)
    m = machine()
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    parts = ["# stream-run vs llama.cpp" + (" — SMOKE RUN (harness check, not the benchmark)" if smoke else ""), ""]
    if smoke:
        parts += [
            "> Smoke run: tiny models or short runs, to check the harness end to end. The machine was shared "
            "with other benchmarks while it ran (see load averages). Do not quote these figures.",
            "",
        ]
    parts += [
        f"- date: {now}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']} RAM, Linux {m['kernel']}",
        f"- machine state when the report was written: {m['state']}",
        f"- disk: {m['disk']}",
        f"- stream-run: {m['stream_run_commit']}",
        f"- llama.cpp: {llama_versions(args)['llama_cpp_python / llama.cpp']} (llama-cpp-python / libllama), "
        f"{args.threads} threads, mmap, n_batch 512",
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        f"- protocol: {args.runs} round(s), variants alternate order each round; page cache evicted before "
        f"every run; figures are medians over rounds; disk reads and peak RSS measured from outside "
        f"(wait4 rusage of the command), the other figures are the tools' own.",
        "",
    ]
    summary_rows = [
        "| workload | stream-run decode | llama.cpp decode | ratio | stream-run prefill | llama.cpp prefill "
        "| ratio | logits cos min / top-1 | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sections = []
    for r in results:
        w = WORKLOADS[r["workload"]]
        summ = r["summary"]
        sr = next((l for l in summ if l.startswith("stream-run")), None)
        ll = summ.get("llama.cpp", {})
        s = summ.get(sr, {}) if sr else {}
        ag = r.get("agreement") or {}
        agree_txt = f"{ag['cos_min']:.4f} / {100 * ag['top1']:.0f}%" if "cos_min" in ag else "-"
        tl = targets_line(r["workload"], w, summ) or "-"
        if w.ttft:
            summary_rows.append(
                f"| {r['workload']} | ttft {fmt(s.get('wall_s'))} s | ttft {fmt(ll.get('wall_s'))} s | "
                f"{fmt(ratio(s.get('wall_s'), ll.get('wall_s')))}x | | | | {agree_txt} | {tl} |"
            )
        else:
            summary_rows.append(
                f"| {r['workload']} | {fmt(s.get('tg_tok_s'))} | {fmt(ll.get('tg_tok_s'))}"
                f"{' (' + ', '.join(ll['failures']) + ')' if ll.get('failures') else ''} | "
                f"{fmt(ratio(s.get('tg_tok_s'), ll.get('tg_tok_s')))}x | {fmt(s.get('pp_tok_s'))} | "
                f"{fmt(ll.get('pp_tok_s'))} | {fmt(ratio(s.get('pp_tok_s'), ll.get('pp_tok_s')))}x | {agree_txt} | {tl} |"
            )
        loads = [run.get("loadavg_before", "?").split()[0] for run in r["runs"]]
        sections += [
            f"## {r['workload']}: {w.about}",
            "",
            f"Model `{r['model']}` ({fmt(r['model_bytes'], 'B')}), pp {w.pp}, tg {w.tg}"
            + (f", cgroup cap {w.cap}" if w.cap else "")
            + f"; 1-minute load average before the runs: {', '.join(loads)} ({os.cpu_count()} cores).",
            "",
            workload_table(r["workload"], w, summ, r.get("agreement")),
            "",
        ]
        if targets_line(r["workload"], w, summ):
            sections += [f"Target: {targets_line(r['workload'], w, summ)}", ""]
    parts += [
        "## Summary",
        "",
        *summary_rows,
        "",
        "Decode counts greedy single-token steps after the prefill (tg - 1 of them); the prompt is "
        "`stream-run bench`'s fixed pseudo-random ids, identical for both tools. Random routers spread "
        "tokens almost uniformly over experts, the worst case for any expert cache: read every hit rate "
        "with that in mind.",
        "",
        *sections,
        "## Commands",
        "",
    ]
    for r in results:
        parts.append(f"- {r['workload']}:")
        cmds = {run["label"]: run["cmd"] for run in r["runs"]}
        for label, c in cmds.items():
            parts.append(
                f"  - {label}{' (in cgroup, cap ' + r['runs'][0]['cap'] + ')' if r['runs'][0].get('cap') else ''}: `{c}`"
            )
        for k, c in (r.get("agreement") or {}).get("commands", {}).items():
            parts.append(f"  - logits, {k}: `{c[:300]}{' ...' if len(c) > 300 else ''}`")
    parts += ["", "## Raw figures (one JSON object per run)", "", "```"]
    for r in results:
        for run in r["runs"]:
            raw = {k: v for k, v in run.items() if k != "stderr_tail"}
            raw["workload"] = r["workload"]
            if isinstance(raw.get("tool"), dict) and isinstance(raw["tool"].get("tokens"), list):
                raw["tool"] = {**raw["tool"], "tokens": raw["tool"]["tokens"][:32]}
            raw["cmd"] = raw["cmd"][:400]
            parts.append(json.dumps(raw))
        if r.get("agreement"):
            parts.append(
                json.dumps(
                    {
                        "workload": r["workload"],
                        "agreement": {k: v for k, v in r["agreement"].items() if k != "commands"},
                    }
                )
            )
    parts += ["```", ""]
    text = "\n".join(parts)
    if not args.dry_run:
        out.write_text(text)
    return "\n".join(["", *summary_rows, ""]) + "\n" + "\n".join(sections)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "-w",
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help=f"repeatable (default: {' '.join(DEFAULT_WORKLOADS)})",
    )
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    ap.add_argument("--models-dir", type=Path, default=Path("/work/models"))
    ap.add_argument("--runs", type=int, default=1, help="rounds per workload (order alternates)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, help="override every workload's prompt length")
    ap.add_argument("--tg", type=int, help="override every workload's decode length")
    ap.add_argument("--n-logits", type=int, default=32, help="positions compared under teacher forcing")
    ap.add_argument("--no-logits", action="store_true", help="skip the logits agreement step")
    ap.add_argument("--skip-no-repack", action="store_true", help="only llama.cpp's default (repacking) variant")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/opt/llamavenv/bin/python"))
    ap.add_argument("--stream-run", default=os.environ.get("STREAM_RUN", "/opt/dev/bin/stream-run"))
    ap.add_argument("--llama-args", default="", help="extra arguments for bench/llama_run.py")
    ap.add_argument("--sr-args", default="", help="extra arguments for stream-run bench/run")
    ap.add_argument("--sr-budget", help="stream-run --ram-budget (default: capped workloads get cap - margin)")
    ap.add_argument(
        "--budget-margin",
        default="0",
        help="under a cap, stream-run gets --ram-budget = cap - this (default 0: the budget is the cap)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    ap.add_argument("--keep-logs", action="store_true", help="keep llama.cpp's loader lines in the raw figures")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--json-out", type=Path, help="also write every result as JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)

    if args.list:
        for k, w in WORKLOADS.items():
            print(
                f"{k:12} {w.preset} {w.qtype} pp {w.pp} tg {w.tg}{' cap ' + w.cap if w.cap else ''}"
                f"{' ttft' if w.ttft else ''}{' +logits' if w.logits else ''}: {w.about}"
            )
        return 0
    if os.geteuid() != 0:
        print("warning: not root: page-cache eviction may be partial and cgroup caps are unavailable", file=sys.stderr)
    has_bench = stream_run_has_bench(args.stream_run)
    print(
        f"stream-run timing: {'stream-run bench --json' if has_bench else 'stream-run run (fallback: no bench command)'}",
        file=sys.stderr,
    )
    results = []
    for name in args.workload or DEFAULT_WORKLOADS:
        w = WORKLOADS[name]
        if args.pp or args.tg:
            from dataclasses import replace

            w = replace(w, pp=args.pp or w.pp, tg=args.tg or w.tg)
            WORKLOADS[name] = w
        print(f"== {name}: {w.about}", file=sys.stderr)
        path = ensure_model(args, w)
        n_vocab = n_vocab_of(path) if path.exists() else 0
        prompt = bench_prompt(n_vocab, w.pp) if n_vocab else list(range(w.pp))
        vs = variants(args, w, path, prompt, has_bench)
        if w.ttft and not args.dry_run:  # "JIT cache warm": one discarded stream-run run first
            print("  warming numba's cache (discarded run)", file=sys.stderr)
            cgroup.run_capped(vs[-1][1], None, timeout=args.timeout)
        runs = []
        for rnd in range(args.runs):
            order = vs if rnd % 2 == 0 else vs[::-1]
            for label, cmd in order:
                runs.append(run_one(args, w, path, label, cmd, rnd))
        agreement = None
        if w.logits and not args.no_logits:
            print("  logits agreement (teacher forcing)", file=sys.stderr)
            agreement = logits_agreement(
                args,
                w,
                path,
                prompt[: args.n_logits]
                if len(prompt) >= args.n_logits
                else bench_prompt(n_vocab or 256, args.n_logits),
            )
        results.append(
            {
                "workload": name,
                "model": str(path),
                "model_bytes": path.stat().st_size if path.exists() else 0,
                "runs": runs,
                "summary": summarize(runs) if not args.dry_run else {},
                "agreement": agreement,
            }
        )
    if args.dry_run:
        return 0
    print(write_report(args, results, args.out))
    print(f"wrote {args.out}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
