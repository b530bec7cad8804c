#!/usr/bin/env python
"""`stream-run perplexity` against the perplexity computed from llama.cpp's logits, on the same tokens and windows,
and teacher-forced top-1 agreement, for the packaged trained models (correctness, not timing).

    python bench/ppl_vs_llama.py [MODEL.gguf ...] [-c 256] [--chunks 16] [--llama-python /opt/llamavenv/bin/python]

For each model: the held-out text (tests/data/heldout_stdlib.py.txt) is tokenized by stream-run (and by
llama.cpp, to check they agree), cut into llama-perplexity's windows; llama.cpp evaluates every window from
position 0 (bench/llama_logits.py under the llama.cpp venv); its logits are scored exactly as
streamer/perplexity.py scores ours. Printed: both perplexities and their relative difference (target: within
0.5%), stream-run streamed at a 25% expert cache (must equal resident to the last digit), and the share of
scored positions where both argmaxes agree (targets: >= 99% dense, >= 97% MoE).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODELS = [REPO / "streamer" / "models" / n for n in ("stdlib-qwen3-q8_0.gguf", "stdlib-qwen3moe-q8_0.gguf")]
HELDOUT = REPO / "tests" / "data" / "heldout_stdlib.py.txt"


def compare(path: Path, n_ctx: int, chunks: int, llama_python: str) -> dict:
    from streamer.experts.store import ExpertLayout
    from streamer.options import StreamOptions
    from streamer.perplexity import perplexity, plan, token_nll, window_tokens
    from streamer.session import open_model

    with open_model(path, StreamOptions(stream=False, learn=False), n_ctx=n_ctx, threads=1) as s:
        tok = s.tokenizer
        ids = np.asarray(tok.encode(HELDOUT.read_text(encoding="utf-8")), np.int64)
        n_chunk = plan(len(ids), n_ctx, chunks)
        bos = tok.bos_id if tok.add_bos else None
        first = n_ctx // 2
        wins = np.stack([window_tokens(ids, i, n_ctx, bos) for i in range(n_chunk)])
        ours = perplexity(s.model, ids, n_ctx, chunks, bos_id=bos)
        top_ours = []
        for w in wins:  # teacher-forced logits of every scored position
            c = s.model.new_state()
            top_ours.append(s.model.forward(w[: n_ctx - 1], c, all_logits=True)[first:].argmax(1))
        streamed = None
        if s.cfg.is_moe:
            lay = ExpertLayout(s.gf, s.cfg)
            with open_model(
                path, StreamOptions(learn=False, expert_cache_bytes=lay.total_bytes // 4), n_ctx=n_ctx, threads=1
            ) as st:
                assert st.streaming
                streamed = perplexity(st.model, ids, n_ctx, chunks, bos_id=bos)
    with tempfile.TemporaryDirectory() as d:
        np.save(f"{d}/w.npy", wins)
        p = subprocess.run(
            [
                llama_python,
                str(REPO / "bench" / "llama_logits.py"),
                str(path),
                "--windows",
                f"{d}/w.npy",
                "--first",
                str(first),
                "--out",
                f"{d}/l.npy",
                "--text",
                str(HELDOUT),
                "--tokens-out",
                f"{d}/t.npy",
            ],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            raise SystemExit(f"llama.cpp run failed:\n{p.stderr[-3000:]}")
        info = json.loads(p.stdout.strip().splitlines()[-1])
        logits = np.load(f"{d}/l.npy")
        llama_ids = np.load(f"{d}/t.npy")
    nll = np.concatenate([token_nll(logits[i], wins[i, first + 1 :]) for i in range(n_chunk)])
    ppl_llama = float(np.exp(nll.mean()))
    agree = np.mean(np.concatenate([logits[i].argmax(1) == top_ours[i] for i in range(n_chunk)]))
    return {
        "model": path.name,
        "n_ctx": n_ctx,
        "chunks": n_chunk,
        "tokens_scored": int(nll.size),
        "tokenizers_agree": bool(len(llama_ids) == len(ids) and np.array_equal(llama_ids, ids)),
        "llama_add_bos": info["add_bos"],
        "ppl_stream_run": ours.ppl,
        "ppl_stderr": ours.stderr,
        "ppl_llama_cpp": ppl_llama,
        "rel_diff": ours.ppl / ppl_llama - 1,
        "ppl_streamed_25pct": None if streamed is None else streamed.ppl,
        "streamed_equals_resident": None
        if streamed is None
        else (streamed.nll, streamed.running) == (ours.nll, ours.running),
        "top1_agreement": float(agree),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", type=Path, default=MODELS)
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--llama-python", default="/opt/llamavenv/bin/python")
    a = ap.parse_args()
    rows = [compare(m, a.ctx, a.chunks, a.llama_python) for m in a.models]
    for r in rows:
        print(json.dumps(r))
    print(
        "\n| model | windows x scored | stream-run PPL | llama.cpp PPL | difference | streamed 25% == resident "
        "| top-1 agreement | tokenizers agree |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        same = "-" if r["streamed_equals_resident"] is None else ("yes" if r["streamed_equals_resident"] else "NO")
        print(
            f"| {r['model']} | {r['chunks']} x {r['tokens_scored'] // r['chunks']} | {r['ppl_stream_run']:.4f} "
            f"+/- {r['ppl_stderr']:.4f} | {r['ppl_llama_cpp']:.4f} | {100 * r['rel_diff']:+.3f}% | {same} "
            f"| {100 * r['top1_agreement']:.2f}% | {'yes' if r['tokenizers_agree'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
