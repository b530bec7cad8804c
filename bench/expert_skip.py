#!/usr/bin/env python
"""Cache-aware expert skipping (--expert-skip W) against expert top-p at equal bytes, on the packaged trained
Qwen3-MoE with a quarter of its experts cached.

    python bench/expert_skip.py [--tokens 4096] [--ctx 256] [--skips 0.02,0.05,0.1] [--json-out skip.json]

Skipping depends on what the cache holds, so it is measured the way a user meets it: each window of --ctx
held-out tokens (tests/data/heldout_stdlib.py.txt, never seen in training) starts from an empty KV cache
(the expert cache carries on), its first half goes in as one prompt call and its second half is decoded
one token at a time, teacher-forced, with the default prefetch. The perplexity is over the decoded tokens
(each predicted from the one before it, as llama-perplexity scores a window's second half), and the bytes
read per decoded token are the expert cache's own counters (demand + prefetch reads).

For each W, expert top-p is bisected until it reads the same bytes per decoded token (within --match), and
both perplexities are reported beside the exact run's. Counts and perplexities, not timings: safe on a busy
machine (one compute thread).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from streamer.config import ModelConfig  # noqa: E402
from streamer.experts.store import ExpertLayout  # noqa: E402
from streamer.gguf_file import GGUFFile  # noqa: E402
from streamer.options import StreamOptions  # noqa: E402
from streamer.session import open_model  # noqa: E402
from streamer.tokenizer import Tokenizer  # noqa: E402

DEFAULT_MODEL = REPO / "streamer" / "models" / "stdlib-qwen3moe-q8_0.gguf"
HELDOUT = REPO / "tests" / "data" / "heldout_stdlib.py.txt"
THREADS = 1


def nll(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64) - logits.max()
    return math.log(np.exp(z).sum()) - z[target]


def decode_ppl(
    path: Path, ids: np.ndarray, ctx: int, share: float, top_p: float, skip: float, prefetch: bool = True
) -> dict:
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    n_slots = max(int(round(share * cfg.n_layer * cfg.n_expert)), 2 * cfg.n_expert_used)
    opts = StreamOptions(
        learn=False,
        prefetch=prefetch,
        expert_top_p=top_p,
        expert_skip=skip,
        expert_cache_bytes=n_slots * ExpertLayout(gf, cfg).slot_bytes,
    )
    half = ctx // 2
    total, count, read, skipped, share_w, uses, tokens = 0.0, 0, 0, 0, 0.0, 0, 0
    with open_model(path, opts, n_ctx=ctx, threads=THREADS) as s:
        assert s.streaming
        traffic = s.traffic
        state = s.model.new_state()
        for w0 in range(0, len(ids) - ctx + 1, ctx):
            win = ids[w0 : w0 + ctx]
            state.truncate(0)
            logits = s.model.forward(win[:half], state)
            before = traffic.totals()
            for p in range(half, ctx):
                total += nll(logits, int(win[p]))
                count += 1
                if p + 1 < ctx:
                    logits = s.model.forward(win[p : p + 1], state)
            after = traffic.totals()
            read += (after.read_bytes + after.prefetch_bytes) - (before.read_bytes + before.prefetch_bytes)
            skipped += after.skipped_bytes - before.skipped_bytes
            share_w += after.skipped_share - before.skipped_share
            uses += after.routed - before.routed
            tokens += after.tokens - before.tokens
    steps = tokens / cfg.n_layer  # decoded tokens (each counted once per layer)
    return {
        "top_p": top_p,
        "skip": skip,
        "n_slots": n_slots,
        "ppl": math.exp(total / count),
        "scored": count,
        "read_MiB_per_token": read / steps / 2**20,
        "skipped_MiB_per_token": skipped / steps / 2**20,
        "skipped_weight_share": share_w / tokens if tokens else 0.0,
        "experts_per_layer_token": uses / tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--share", type=float, default=0.25, help="share of all experts the cache holds")
    ap.add_argument("--skips", default="0.02,0.05,0.1")
    ap.add_argument("--match", type=float, default=0.01, help="relative bytes tolerance of the top-p bisection")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="without the lookahead prefetch")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    os.environ["STREAM_RUN_CACHE"] = tempfile.mkdtemp(prefix="expert-skip-")  # no learned profile is touched
    ids = np.asarray(Tokenizer.from_gguf(GGUFFile(a.model)).encode(HELDOUT.read_text(encoding="utf-8")), np.int64)
    ids = ids[: a.tokens]

    def run(top_p=1.0, skip=0.0):
        r = decode_ppl(a.model, ids, a.ctx, a.share, top_p, skip, a.prefetch)
        print(
            f"top-p {top_p:.4f} skip {skip:g}: ppl {r['ppl']:.4f}, {r['read_MiB_per_token']:.3f} MiB/token, "
            f"{r['experts_per_layer_token']:.2f} experts/layer/token",
            file=sys.stderr,
            flush=True,
        )
        return r

    base = run()
    rows = []
    for w in (float(x) for x in a.skips.split(",")):
        sk = run(skip=w)
        lo, hi, best = 0.3, 1.0, None  # top-p reading the same bytes: fewer bytes as top-p falls
        for _ in range(12):
            mid = (lo + hi) / 2
            tp = run(top_p=mid)
            if best is None or abs(tp["read_MiB_per_token"] - sk["read_MiB_per_token"]) < abs(
                best["read_MiB_per_token"] - sk["read_MiB_per_token"]
            ):
                best = tp
            gap = tp["read_MiB_per_token"] / sk["read_MiB_per_token"] - 1
            if abs(gap) <= a.match:
                break
            lo, hi = (mid, hi) if gap < 0 else (lo, mid)
        rows.append({"skip": sk, "top_p": best})
    out = {"model": str(a.model), "tokens": len(ids), "ctx": a.ctx, "share": a.share, "prefetch": a.prefetch}
    out.update(exact=base, rows=rows)
    print(table(out))
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1))


def table(out: dict) -> str:
    b = out["exact"]
    lines = [
        f"exact: ppl {b['ppl']:.4f}, {b['read_MiB_per_token']:.3f} MiB read/token, {b['scored']} tokens scored, "
        f"cache {b['n_slots']} slots ({out['share']:.0%}), prefetch {'on' if out['prefetch'] else 'off'}",
        "",
        "| W | skipped weight | reads avoided | ppl change | top-p at equal bytes | its ppl change |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        s, t = r["skip"], r["top_p"]
        saved = 1 - s["read_MiB_per_token"] / b["read_MiB_per_token"]
        lines.append(
            f"| {s['skip']:g} | {100 * s['skipped_weight_share']:.2f}% | {100 * saved:.1f}% "
            f"| {100 * (s['ppl'] / b['ppl'] - 1):+.2f}% | {t['top_p']:.4f} "
            f"({100 * (1 - t['read_MiB_per_token'] / b['read_MiB_per_token']):.1f}% avoided) "
            f"| {100 * (t['ppl'] / b['ppl'] - 1):+.2f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
