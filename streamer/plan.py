"""`stream-run plan`: will this MoE model run on this machine, and how fast, at each RAM budget?

Inputs:
- a disk probe: random whole-expert reads of the model file with the runtime's own reader (O_DIRECT where the
  filesystem allows it), first one at a time (latency), then with as many threads as the runtime's readers
  (throughput); a few seconds, cached per device and read mode;
- the per-layer expert sizes and the budget plan (the runtime's arithmetic, budget.split_at);
- the compute time of one decode step, measured: the same one-token step is run cold once (its weights come
  into memory), then timed warm, so it is the kernels and the Python around them, without I/O;
- a hit-rate model: the replay of a routing trace (`--trace`, the runtime's pinned-LRU policy, decode steps),
  or without one the uniform-routing bound (a cache holding a share s of the experts hits s of the requests:
  what any policy gets when routing is uniform and independent).

Model: a decoded token takes compute + (expert bytes read per token) / (disk throughput); time to first token
takes the non-expert weights and the prompt's experts read cold plus the prompt's compute (one decode step
per prompt token: an upper bound, prefill batches)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

import streamer.model  # noqa: F401  the RSS baseline counts what a run has imported when it plans
import streamer.moe_build  # noqa: F401
from streamer.budget import MARGIN_DIV, MARGIN_FIXED, available_memory, cgroup_limit, resolve, scratch_bytes, split_at
from streamer.buffers import aligned_empty
from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout, ExpertReader
from streamer.experts.usage import cache_dir
from streamer.gguf_file import GGUFFile
from streamer.io import atomic_write, human
from streamer.options import READERS, StreamOptions
from streamer.replay import ReplayOptions, recorded_policy, replay, slots_at
from streamer.session import open_model
from streamer.trace import check_model, load_trace

PROBE_FORMAT = "stream-run-disk-probe/1"


@dataclass(frozen=True)
class PlanOptions:
    budgets: tuple | None = None  # bytes; None: a ladder up to the machine's memory
    trace: Path | None = None
    n_ctx: int | None = None
    prompt_tokens: int = 16
    probe_seconds: float = 3.0
    reprobe: bool = False
    n_readers: int = READERS  # the runtime's (StreamOptions.readers)
    threads: int | None = None


# ---- the disk probe ----


def device_id(path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}-{os.minor(st.st_dev)}"


def probe_path(path, direct: bool) -> Path:
    return cache_dir() / "disk" / f"dev-{device_id(path)}-{'direct' if direct else 'buffered'}.json"


def probe_disk(gf, layout, seconds: float, n_threads: int, progress=None) -> dict:
    """Random whole-expert reads with the runtime's ExpertReader: a third of the time one at a time, the rest
    with n_threads in parallel."""
    reader = ExpertReader(gf.files, layout)
    rng = np.random.default_rng()
    t_end = [0.0]
    done = [0, 0]  # reads, bytes
    lock = threading.Lock()

    def loop(seed):
        r = np.random.default_rng(seed)
        buf = aligned_empty(layout.slot_bytes)
        n = b = 0
        while time.perf_counter() < t_end[0]:
            layer, e = int(r.integers(layout.n_layer)), int(r.integers(layout.n_expert))
            reader.read(layer, e, buf)
            n += 1
            b += layout.expert_bytes(layer)
        with lock:
            done[0] += n
            done[1] += b
        return n, b

    try:
        t0 = time.perf_counter()
        t_end[0] = t0 + seconds / 3
        n1, _ = loop(int(rng.integers(1 << 30)))
        latency = (time.perf_counter() - t0) / max(n1, 1)
        if progress:
            progress(1, 2)
        t0 = time.perf_counter()
        t_end[0] = t0 + 2 * seconds / 3
        with ThreadPoolExecutor(n_threads) as ex:
            res = list(ex.map(loop, rng.integers(1 << 30, size=n_threads).tolist()))
        elapsed = time.perf_counter() - t0
        if progress:
            progress(2, 2)
        nbytes = sum(b for _, b in res)
    finally:
        reader.close()
    return {
        "format": PROBE_FORMAT,
        "device": device_id(gf.path),
        "direct": reader.direct,
        "latency_s": latency,
        "throughput_Bps": nbytes / elapsed,
        "threads": n_threads,
        "reads": n1 + sum(n for n, _ in res),
        "read_bytes": int(np.mean(layout_sizes(layout))),
        "when": time.time(),
    }


def layout_sizes(layout) -> list[int]:
    return [layout.expert_bytes(i) for i in range(layout.n_layer)]


def disk_figures(gf, layout, opts: PlanOptions, progress=None) -> dict:
    """The cached probe of this device and read mode, else a fresh one (saved atomically)."""
    r = ExpertReader(gf.files, layout)
    direct = r.direct
    r.close()
    where = probe_path(gf.path, direct)
    size = int(np.mean(layout_sizes(layout)))
    if not opts.reprobe and where.exists():
        try:
            d = json.loads(where.read_text())
            if (
                d.get("format") == PROBE_FORMAT
                and d.get("threads") == opts.n_readers
                and 0.5 <= d.get("read_bytes", 0) / size <= 2.0
                and d["throughput_Bps"] > 0
            ):
                d["cached"] = str(where)
                return d
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            pass  # a damaged cache entry: probe again
    d = probe_disk(gf, layout, opts.probe_seconds, opts.n_readers, progress)
    where.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(where, lambda f: f.write(json.dumps(d).encode()))
    d["cached"] = None
    return d


# ---- compute ----


def measure_decode_step(path, n_ctx, threads, repeats: int = 5) -> float:
    """Seconds of one warm decode step (the median): the same token at position 0 run once cold, then `repeats`
    times warm (same routing, so every weight it uses is already in memory)."""
    with open_model(path, StreamOptions(stream=False, learn=False, prefetch=False), n_ctx=n_ctx, threads=threads) as s:
        tok = np.array([min(1000, s.cfg.n_vocab - 1)], np.int64)
        s.model.forward(tok, s.model.new_state())
        times = []
        for _ in range(repeats):
            c = s.model.new_state()
            t0 = time.perf_counter()
            s.model.forward(tok, c)
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ---- the prediction ----


def machine_memory() -> int:

    total = psutil.virtual_memory().total
    limit = cgroup_limit()
    return total if limit is None else min(total, limit)


def budget_ladder(plan_parts: dict, geometry: dict, top: int, also=()) -> list[int]:
    """From the smallest budget that runs to `top`: powers of two GiB, the smallest and the all-resident
    budget, and `also` (e.g. the default budget); nothing beyond the first all-resident one but `top`."""
    p = plan_parts
    rest = p["baseline"] + p["nonexpert"] + p["kv"] + p["scratch"]
    lo = -(-(rest + geometry["n_expert_used"] * geometry["slot_bytes"] + MARGIN_FIXED) * MARGIN_DIV // (MARGIN_DIV - 1))
    resident = -(-(rest + p["expert_total"] + MARGIN_FIXED) * MARGIN_DIV // (MARGIN_DIV - 1))
    cands = {lo, top, *also} | {g * 2**30 for g in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)}
    # and the budgets whose expert cache holds 10%, 25%, 50% and 75% of the experts
    cands |= {
        -(-(rest + int(s * p["expert_total"]) + MARGIN_FIXED) * MARGIN_DIV // (MARGIN_DIV - 1))
        for s in (0.1, 0.25, 0.5, 0.75)
    }
    cands |= {resident} if resident <= top else set()
    out = []
    for b in sorted(c for c in cands if lo <= c <= top):
        fits = split_at(
            b, p["baseline"], p["nonexpert"], p["kv"], p["scratch"], p["expert_total"], p["slot_bytes"]
        ).fits_resident
        out.append(b)
        if fits and b != top:
            out += [top] if top > b else []
            break
    return sorted(set(out) | {a for a in also if lo <= a <= top})


def uniform_hit_rate(n_slots: int, geometry: dict) -> float:
    return min(1.0, n_slots / (geometry["n_layer"] * geometry["n_expert"]))


def distinct_experts(prompt_tokens: int, geometry: dict) -> float:
    """Expected experts a prompt of this many tokens routes to, all layers, under uniform routing."""
    e, k = geometry["n_expert"], geometry["n_expert_used"]
    return geometry["n_layer"] * e * (1 - (1 - k / e) ** prompt_tokens)


def predict(
    parts: dict, geometry: dict, budgets, step_s: float, disk: dict, prompt_tokens: int, replayed: dict | None
) -> list[dict]:
    """One row per budget (and per policy, with a replay): hit rate, bytes per token, tok/s, TTFT."""
    bw = disk["throughput_Bps"]
    mean_expert = float(np.mean(geometry["expert_bytes"]))
    ttft_io = parts["nonexpert"] / bw + distinct_experts(prompt_tokens, geometry) * mean_expert / bw
    ttft = ttft_io + prompt_tokens * step_s
    rows = []
    replay_rows = {} if replayed is None else {(r["budget"], r["policy"]): r for r in replayed["results"]}
    policies = ("uniform",) if replayed is None else tuple(dict.fromkeys(r["policy"] for r in replayed["results"]))
    for b in budgets:
        n_slots, _, state, _ = slots_at(parts, geometry, b)
        for pol in policies:
            if state == "too small":
                rows.append({"budget": b, "policy": pol, "state": state})
                continue
            if state == "resident":
                hit, per_tok = 1.0, 0.0
            elif pol == "uniform":
                hit = uniform_hit_rate(n_slots, geometry)
                per_tok = geometry["n_layer"] * geometry["n_expert_used"] * (1 - hit) * mean_expert
            else:
                d = replay_rows[(b, pol)]["decode"]
                hit, per_tok = d["hit_rate"], d["read_bytes_per_token"]
            # Reads overlap compute: the router lookahead reads layer L+1's experts while layer L computes, and
            # the readers work beside the compute thread. Measured on the 30B-A3B file under cgroup caps of 6, 8
            # and 12 GiB, this was within 12% of the real speed; compute + reads in series was 28-32% slow.
            rows.append(
                {
                    "budget": b,
                    "policy": pol,
                    "state": state,
                    "n_slots": n_slots,
                    "hit_rate": hit,
                    "read_bytes_per_token": per_tok,
                    "decode_tok_s": 1.0 / max(step_s, per_tok / bw),
                    "ttft_s": ttft,
                    # the pessimistic bound: no overlap at all (e.g. --no-prefetch with every read a demand read)
                    "decode_tok_s_serial": 1.0 / (step_s + per_tok / bw),
                }
            )
    return rows


def recommend(rows: list[dict], policy: str, limit: int | None = None) -> dict | None:
    """The smallest budget whose predicted decode speed is within 10% of the best (runtime policy), among those
    up to `limit` (the memory available now: a budget beyond it cannot be had)."""
    ok = [
        r
        for r in rows
        if r["policy"] == policy and r["state"] != "too small" and (limit is None or r["budget"] <= limit)
    ]
    if not ok:
        return None
    best = max(r["decode_tok_s"] for r in ok)
    return min((r for r in ok if r["decode_tok_s"] >= 0.9 * best), key=lambda r: r["budget"])


def make_plan_report(model, opts: PlanOptions, progress=None, say=None) -> dict:

    say = say or (lambda msg: None)
    gf = GGUFFile(model)
    cfg = ModelConfig.from_gguf(gf)
    if not cfg.is_moe:
        raise StreamerError(
            f"{model} is a dense model: it has no experts to stream, so its decode speed does not "
            f"depend on the budget (`stream-run bench` measures it)"
        )
    trace = None
    if opts.trace is not None:
        trace = load_trace(opts.trace)
        check_model(trace, gf)
    layout = ExpertLayout(gf, cfg)
    geometry = {
        "n_layer": cfg.n_layer,
        "n_expert": cfg.n_expert,
        "n_expert_used": cfg.n_expert_used,
        "expert_bytes": layout_sizes(layout),
        "slot_bytes": layout.slot_bytes,
        "layer_slot_bytes": layout.layer_slot_bytes,
    }
    if trace is not None:
        parts = dict(trace.header["plan"])
    else:
        parts = {
            "budget": None,
            "baseline": psutil.Process().memory_info().rss,
            "nonexpert": sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name),
            "kv": cfg.state_bytes(cfg.context(opts.n_ctx)),
            "scratch": scratch_bytes(cfg),
            "expert_total": layout.total_bytes,
            "slot_bytes": layout.slot_bytes,
        }
    top, avail = machine_memory(), available_memory()
    default = resolve(None)
    budgets = list(opts.budgets) if opts.budgets else budget_ladder(parts, geometry, avail, (default,))
    say(f"disk probe: random {np.mean(geometry['expert_bytes']) / 2**20:.1f} MiB expert reads of {Path(model).name}")
    disk = disk_figures(gf, layout, opts, progress)
    say("compute: timing a warm decode step")
    step_s = measure_decode_step(model, opts.n_ctx, opts.threads)
    replayed = None
    if trace is not None:
        say(f"hit rates: replaying {trace.path.name} at {len(budgets)} budgets")
        replayed = replay(trace, ReplayOptions(tuple(budgets), ("pinned-lru", "lru", "lfu", "belady")))
    rows = predict(parts, geometry, budgets, step_s, disk, opts.prompt_tokens, replayed)
    policy = "uniform" if trace is None else recorded_policy(trace)
    return {
        "model": str(model),
        "model_bytes": gf.size,
        "geometry": geometry,
        "plan_parts": parts,
        "machine_memory": top,
        "available_memory": avail,  # now: the ladder's top, and what a recommendation may ask for
        "default_budget": default,
        "disk": disk,
        "decode_step_s": step_s,
        "prompt_tokens": opts.prompt_tokens,
        "hit_model": "uniform routing bound" if trace is None else f"replay of {trace.path.name}",
        "policy": policy,
        "rows": rows,
        "recommended": recommend(rows, policy, avail),
        "replay": replayed,
    }


def format_plan(r: dict) -> str:
    g, d = r["geometry"], r["disk"]
    sizes = sorted(set(g["expert_bytes"]))
    size_txt = ", ".join(f"{human(s)} ({sum(1 for b in g['expert_bytes'] if b == s)} layers)" for s in sizes)
    lines = [
        f"model    {r['model']} ({human(r['model_bytes'])}): {g['n_layer']} layers x {g['n_expert']} experts, "
        f"{g['n_expert_used']} used; expert size {size_txt}; non-expert weights {human(r['plan_parts']['nonexpert'])}",
        (
            f"disk     {d['throughput_Bps'] / 1e9:.2f} GB/s with {d['threads']} readers, {1e3 * d['latency_s']:.1f} ms "
            f"per expert read alone ({'O_DIRECT' if d['direct'] else 'buffered: the page cache may serve some reads'}; "
            + (f"cached probe {d['cached']}" if d.get("cached") else "probed now")
            + ")"
        ),
        f"compute  {1e3 * r['decode_step_s']:.0f} ms per decode step (measured: one warm step, weights in memory)",
        f"hits     {r['hit_model']} (decode steps{', ' + r['policy'] + ' policy' if r['policy'] != 'uniform' else ''})",
        f"memory   {human(r['machine_memory'])} on this machine, {human(r['available_memory'])} available now "
        f"(cgroup limit included); the default budget is {human(r['default_budget'])}",
        f"{'budget':>10} {'slots':>6} {'hit':>6} {'MiB/tok':>8} {'tok/s':>7} {'serial':>7} {'TTFT s':>7}"
        + (f" {'Belady tok/s':>12}" if r["policy"] != "uniform" else "")
        + f"   ({r['policy']} policy)",
    ]
    ceiling = {row["budget"]: row for row in r["rows"] if row["policy"] == "belady"}
    for row in r["rows"]:
        if row["policy"] != r["policy"]:
            continue
        b = human(row["budget"])
        if row["state"] == "too small":
            lines.append(f"{b:>10} too small: cannot hold one layer's experts")
            continue
        slots = "all" if row["state"] == "resident" else str(row["n_slots"])
        best = ceiling.get(row["budget"])
        lines.append(
            f"{b:>10} {slots:>6} {100 * row['hit_rate']:5.1f}% {row['read_bytes_per_token'] / 2**20:8.1f} "
            f"{row['decode_tok_s']:7.2f} {row['decode_tok_s_serial']:7.2f} {row['ttft_s']:7.1f}"
            + (f" {best['decode_tok_s']:12.2f}" if best is not None else "")
            + ("   <- the default budget" if row["budget"] == r.get("default_budget") else "")
        )
    rec = r["recommended"]
    lines.append(
        "tok/s: reads fully overlapped with compute; serial: none overlapped (a bound below, nearer the real speed "
        "when the lookahead's reads cannot land within a layer's compute)"
    )
    lines.append(
        f"TTFT: a {r['prompt_tokens']}-token prompt from a cold start (non-expert weights and the prompt's "
        f"experts read, one decode step of compute per prompt token)"
    )
    if rec is not None:
        lines.append(
            f"recommended: --ram-budget {human(rec['budget'])} (predicted {rec['decode_tok_s']:.2f} tok/s, "
            f"the smallest budget within 10% of the fastest)"
        )
    return "\n".join(lines)
