#!/usr/bin/env python
"""Expert-cache behaviour and routing statistics of the packaged trained Qwen3-MoE on held-out text.

    python bench/trained_routing.py [--model streamer/models/stdlib-qwen3moe-q8_0.gguf] [--tokens 2048]
                                    [--json-out routing.json]

Correctness-type measurements (hit rates, recall, bytes, perplexity), not timings: safe on a busy machine.
Every number comes from stream-run itself (the real cache, prefetcher, pinning and traffic), fed the held-out
text (tests/data/heldout_stdlib.py.txt, never seen in training) teacher-forced, one token at a time as in
decoding, in windows of --ctx tokens (the KV cache restarts each window; the expert cache carries on):

1. hit rate vs expert-cache share (10/25/50% of all experts) for LRU alone, learned pinning + LRU (pins learned
   from a separate slice of held-out text, the default pin_share 0.5), each with and without prefetch;
2. router-lookahead recall (prefetch on);
3. expert top-p in {1, 0.95, 0.9, 0.8, 0.7}: experts kept and bytes read per token (25% cache, defaults) against
   the perplexity (llama-perplexity's method, resident, whole held-out text) and its increase;
4. routing statistics per layer: usage entropy, top-expert share of routing mass, experts covering 90% of the
   mass, token-to-token reuse (share of a token's experts the previous token also used), to set beside the
   published Qwen3-30B-A3B figures.
5. LFU and Belady's optimum: each share's LRU no-prefetch run records its routing trace (streamer/trace.py, as
   --trace does), which the replay engine (streamer/replay.py, `stream-run replay`) re-runs at the same cache
   size, no prefetch, under lru (must reproduce the live LRU row exactly: checked), lfu and belady.

--replay-only runs just the three traced LRU runs and their replays (skips pins, prefetch, top-p).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from streamer.options import StreamOptions  # noqa: E402

DEFAULT_MODEL = REPO / "streamer" / "models" / "stdlib-qwen3moe-q8_0.gguf"
HELDOUT = REPO / "tests" / "data" / "heldout_stdlib.py.txt"
SHARES = (0.10, 0.25, 0.50)
TOP_PS = (1.0, 0.95, 0.9, 0.8, 0.7)
# One compute thread: the results are counts, not timings, and on a shared machine two threads wait on each
# other at every parallel kernel (measured here under load: ~1 s per decoded token with 2, a few ms with 1).
THREADS = 1


def heldout_ids(path: Path) -> np.ndarray:
    from streamer.gguf_file import GGUFFile
    from streamer.tokenizer import Tokenizer

    return np.asarray(Tokenizer.from_gguf(GGUFFile(path)).encode(HELDOUT.read_text(encoding="utf-8")), np.int64)


class Recorder:
    """Stands in for the MoE's usage counter: keeps every layer's routing (ids and weights) in order."""

    def __init__(self, n_layer: int):
        self.ids: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
        self.w: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
        self.last_w = None

    def record(self, layer, experts) -> None:
        self.ids[layer].append(np.asarray(experts))
        self.w[layer].append(self.last_w)

    def save(self) -> None:
        pass


def trace(path: Path, ids: np.ndarray, ctx: int):
    """Routing of every held-out token (prefill windows of ctx tokens): per layer (ids (N, k), weights (N, k))."""
    import streamer.moe as moe
    from streamer.session import open_model

    orig = moe.route
    with open_model(path, StreamOptions(stream=False, learn=False), n_ctx=ctx, threads=THREADS) as s:
        rec = Recorder(s.cfg.n_layer)
        s.model.ffn.usage = rec

        def route(logits, k, top_p=1.0):
            out = orig(logits, k, top_p)
            rec.last_w = out[1]
            return out

        moe.route = route
        try:
            cache = s.model.new_state()
            for i in range(0, len(ids) - ctx + 1, ctx):
                cache.truncate(0)
                s.model.forward(ids[i : i + ctx], cache)
        finally:
            moe.route = orig
        k = s.cfg.n_expert_used
        return [(np.concatenate(a).reshape(-1, k), np.concatenate(b)) for a, b in zip(rec.ids, rec.w)], s.cfg


def routing_stats(tr, n_expert: int) -> list[dict]:
    rows = []
    for layer, (ids, w) in enumerate(tr):
        mass = np.bincount(ids.ravel(), weights=w.ravel(), minlength=n_expert)
        share = mass / mass.sum()
        p = share[share > 0]
        srt = np.sort(share)[::-1]
        prev = [len(np.intersect1d(ids[t], ids[t - 1])) for t in range(1, len(ids))]
        rows.append(
            {
                "layer": layer,
                "entropy_norm": float(-(p * np.log(p)).sum() / math.log(n_expert)),
                "top_expert_share": float(srt[0]),
                "experts_for_90pct": int(np.searchsorted(np.cumsum(srt), 0.9) + 1),
                "reuse_prev_token": float(np.mean(prev) / ids.shape[1]),
                "new_vs_prev_token": float(ids.shape[1] - np.mean(prev)),
            }
        )
    return rows


def decode_run(
    path: Path,
    ids: np.ndarray,
    ctx: int,
    share: float,
    prefetch: bool,
    pinned: bool,
    top_p: float = 1.0,
    trace: Path | None = None,
) -> dict:
    """Teacher-forced decode of ids through a streaming session; the traffic counters' report. trace: record the run's
    routing trace there (written when the session closes)."""
    from streamer.config import ModelConfig
    from streamer.experts.store import ExpertLayout
    from streamer.gguf_file import GGUFFile
    from streamer.session import open_model

    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    n_slots = max(int(round(share * cfg.n_layer * cfg.n_expert)), 2 * cfg.n_expert_used)
    opts = StreamOptions(
        learn=pinned,
        prefetch=prefetch,
        expert_top_p=top_p,
        pin_share=0.5 if pinned else 0.0,
        expert_cache_bytes=n_slots * layout.slot_bytes,
    )
    with open_model(path, opts, n_ctx=ctx, threads=THREADS, trace=trace) as s:
        assert s.streaming
        cache = s.model.new_state()
        for i, t in enumerate(ids):
            if i % ctx == 0:
                cache.truncate(0)
            s.model.forward(np.array([t]), cache)
        rep = s.traffic.report()
        pins = len(s.model.ffn.source.cache.pin_set)
        s.model.ffn.usage.learn = False  # never save this run's counts into the learned profile
    t = rep["totals"]
    return {
        "share": share,
        "prefetch": prefetch,
        "pinned": pinned,
        "top_p": top_p,
        "n_slots": n_slots,
        "hit_rate": rep["hit_rate"],
        "prefetched_rate": rep["prefetched_rate"],
        "miss_rate": rep["miss_rate"],
        "recall": rep["prefetch_recall"],
        "read_MiB_per_token": rep["read_bytes_per_token"] / 2**20,
        "demand_reads_per_layer_token": t["miss"] / rep["tokens"] / cfg.n_layer,
        "new_experts_per_layer_token": (t["miss"] + t["hit_prefetched"]) / rep["tokens"] / cfg.n_layer,
        "experts_per_layer_token": t["routed"] / rep["tokens"] / cfg.n_layer,
        "prefetch_wasted": rep["prefetch_wasted"],
        "tokens": rep["tokens"],
        "pins": pins,
        "requests": t["requests"],
        "read_bytes": rep["read_bytes"],
    }


REPLAY_POLICIES = ("lru", "lfu", "belady")


def replay_run(trace_path: Path, live: dict) -> list[dict]:
    """Replay a recorded LRU no-prefetch run at its own cache size, no prefetch, under REPLAY_POLICIES. The lru
    replay must reproduce the live run exactly (requests, hits, demand reads, bytes), or this raises."""
    from streamer.replay import ReplayOptions, replay
    from streamer.trace import load_trace

    tr = load_trace(trace_path)
    n_layer = tr.geometry["n_layer"]
    r = replay(tr, ReplayOptions(budgets=(None,), policies=REPLAY_POLICIES, prefetch=False))
    rows = []
    for res in r["results"]:
        a = res["all"]  # every call of these runs is a one-token decode step
        row = {
            "share": live["share"],
            "policy": res["policy"],
            "n_slots": res["n_slots"],
            "tokens": a["tokens"],
            "requests": a["requests"],
            "hit_rate": a["hit_rate"],
            "prefetched_rate": a["prefetched_rate"],
            "miss_rate": a["miss_rate"],
            "read_MiB_per_token": a["read_bytes_per_token"] / 2**20,
            "read_bytes": a["read_bytes"],
            # no prefetch: every new expert is a demand read (counted back from the rate, an exact ratio)
            "new_experts_per_layer_token": round(a["miss_rate"] * a["requests"]) / a["tokens"] / n_layer,
        }
        rows.append(row)
    lru = rows[0]
    keys = ("n_slots", "tokens", "requests", "hit_rate", "miss_rate", "read_bytes", "new_experts_per_layer_token")
    diff = {k: (live[k], lru[k]) for k in keys if live[k] != lru[k]}
    if diff:
        raise AssertionError(f"replayed LRU differs from the live LRU run at {live['n_slots']} slots: {diff}")
    return rows


def learn_pins(path: Path, ids: np.ndarray, ctx: int) -> None:
    """Build the learned usage profile (in $STREAM_RUN_CACHE) from a slice of text the runs do not score."""
    from streamer.session import open_model

    with open_model(path, StreamOptions(stream=False, learn=True), n_ctx=ctx, threads=THREADS) as s:
        cache = s.model.new_state()
        for i in range(0, len(ids) - ctx + 1, ctx):
            cache.truncate(0)
            s.model.forward(ids[i : i + ctx], cache)


def ppl(path: Path, ids: np.ndarray, ctx: int, top_p: float, chunks: int | None) -> float:
    from streamer.perplexity import perplexity
    from streamer.session import open_model

    opts = StreamOptions(stream=False, learn=False, expert_top_p=top_p)
    with open_model(path, opts, n_ctx=ctx, threads=THREADS) as s:
        return perplexity(s.model, ids, ctx, chunks).ppl


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens decoded per cache configuration")
    ap.add_argument("--learn-tokens", type=int, default=8192, help="held-out tokens (after those) that teach the pins")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--ppl-chunks", type=int, default=None, help="perplexity windows per top-p (default: all)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument(
        "--replay-only",
        action="store_true",
        help="only the traced LRU no-prefetch runs and their lru/lfu/belady replays",
    )
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trained-routing-"))
    os.environ["STREAM_RUN_CACHE"] = str(work)  # the learned profile lives here, not in ~/.cache
    try:
        ids = heldout_ids(a.model)
        run_ids, learn_ids = ids[: a.tokens], ids[a.tokens : a.tokens + a.learn_tokens]
        out: dict = {"model": str(a.model), "heldout_tokens": len(ids), "decoded_tokens": len(run_ids), "ctx": a.ctx}

        if a.replay_only:
            out["cache"], out["replay"] = replay_runs(a.model, run_ids, a.ctx, work)
            from streamer.config import ModelConfig
            from streamer.gguf_file import GGUFFile

            cfg = ModelConfig.from_gguf(GGUFFile(a.model))
            return finish(a, out, cfg)
        tr, cfg = trace(a.model, ids, a.ctx)
        out["routing"] = routing_stats(tr, cfg.n_expert)
        out["replay"] = []
        learn_pins(a.model, learn_ids, a.ctx)
        usage_dir = work / "usage"
        backup = work / "usage.learned"
        shutil.copytree(usage_dir, backup)
        runs = []
        for share in SHARES:
            for pinned in (False, True):
                for prefetch in (False, True):
                    if pinned:  # every pinned run starts from the same learned profile
                        shutil.rmtree(usage_dir)
                        shutil.copytree(backup, usage_dir)
                    tr_path = work / f"trace-{share:.2f}.npz" if not (pinned or prefetch) else None
                    runs.append(decode_run(a.model, run_ids, a.ctx, share, prefetch, pinned, trace=tr_path))
                    print(
                        f"share {share:.2f} pinned {pinned} prefetch {prefetch}: hit {pct(runs[-1]['hit_rate'])}",
                        file=sys.stderr,
                        flush=True,
                    )
                    if tr_path is not None:
                        out["replay"] += replay_run(tr_path, runs[-1])
        out["cache"] = runs
        topp = []
        base = None
        for p in TOP_PS:
            value = ppl(a.model, ids, a.ctx, p, a.ppl_chunks)
            base = base or value
            r = decode_run(a.model, run_ids, a.ctx, 0.25, True, False, top_p=p)
            topp.append(
                {
                    "top_p": p,
                    "ppl": value,
                    "ppl_increase": value / base - 1,
                    "experts_per_layer_token": r["experts_per_layer_token"],
                    "read_MiB_per_token": r["read_MiB_per_token"],
                    "hit_rate": r["hit_rate"],
                }
            )
            print(f"top-p {p}: ppl {value:.4f}", file=sys.stderr, flush=True)
        out["top_p"] = topp
        finish(a, out, cfg)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def replay_runs(path: Path, ids: np.ndarray, ctx: int, work: Path) -> tuple[list, list]:
    runs, rows = [], []
    for share in SHARES:
        tr_path = work / f"trace-{share:.2f}.npz"
        runs.append(decode_run(path, ids, ctx, share, False, False, trace=tr_path))
        rows += replay_run(tr_path, runs[-1])
        print(
            f"share {share:.2f}: " + ", ".join(f"{r['policy']} hit {pct(r['hit_rate'])}" for r in rows[-3:]),
            file=sys.stderr,
            flush=True,
        )
    return runs, rows


def finish(a, out: dict, cfg) -> None:
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1))
    print(tables(out, cfg))


def tables(out: dict, cfg) -> str:
    L = [
        f"Model {Path(out['model']).name}: {cfg.n_layer} layers, {cfg.n_expert} experts, top-{cfg.n_expert_used}; "
        f"{out['decoded_tokens']} held-out tokens decoded one at a time (windows of {out['ctx']}).",
        "",
        "| cache share | policy | prefetch | hit rate | prefetched | demand reads | new experts / layer / token "
        "| MiB read / token | lookahead recall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["cache"]:
        policy = f"learned pins ({r['pins']}) + LRU" if r["pinned"] else "LRU"
        L.append(
            f"| {100 * r['share']:.0f}% ({r['n_slots']} slots) | {policy} "
            f"| {'on' if r['prefetch'] else 'off'} | {pct(r['hit_rate'])} | {pct(r['prefetched_rate'])} "
            f"| {pct(r['miss_rate'])} | {r['new_experts_per_layer_token']:.2f} | {r['read_MiB_per_token']:.3f} "
            f"| {pct(r['recall'])} |"
        )
    names = {"lfu": "LFU (replayed)", "belady": "Belady (optimal, replayed)"}
    for r in out["replay"]:
        if r["policy"] not in names:  # the lru replay equals the live LRU row (replay_run checked that)
            continue
        L.append(
            f"| {100 * r['share']:.0f}% ({r['n_slots']} slots) | {names[r['policy']]} | off | {pct(r['hit_rate'])} "
            f"| {pct(r['prefetched_rate'])} | {pct(r['miss_rate'])} | {r['new_experts_per_layer_token']:.2f} "
            f"| {r['read_MiB_per_token']:.3f} | - |"
        )
    if "top_p" not in out:
        return "\n".join(L)
    L += [
        "",
        "| expert top-p | experts kept / layer / token | MiB read / token (25% cache) | hit rate | perplexity "
        "| increase |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["top_p"]:
        L.append(
            f"| {r['top_p']} | {r['experts_per_layer_token']:.2f} | {r['read_MiB_per_token']:.3f} "
            f"| {pct(r['hit_rate'])} | {r['ppl']:.4f} | {100 * r['ppl_increase']:+.2f}% |"
        )
    L += [
        "",
        "| layer | usage entropy (of max) | top-expert share of mass | experts for 90% of mass "
        "| reuse from previous token | new vs previous token |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["routing"]:
        L.append(
            f"| {r['layer']} | {r['entropy_norm']:.3f} | {pct(r['top_expert_share'])} | {r['experts_for_90pct']}"
            f" of {cfg.n_expert} | {pct(r['reuse_prev_token'])} | {r['new_vs_prev_token']:.2f} |"
        )
    return "\n".join(L)


if __name__ == "__main__":
    main()
