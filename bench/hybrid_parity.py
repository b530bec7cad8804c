#!/usr/bin/env python
"""Teacher-forced logits of tiny hybrid files (qwen35moe, qwen3next) from stream-run and llama.cpp, each against the float64
reference (tests/reference.py): cosine and top-1 agreement per file, single and split.

    python bench/hybrid_parity.py --llama-python /path/to/llama-venv/bin/python [--tokens 64] [--out DIR]

Runs under the project's venv; llama.cpp runs in its own (bench/llama_logits.py). Files are written with
`stream-run synth` into --out (kept: the figures can be checked again).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reference import Reference, cosines  # noqa: E402

from streamer.options import StreamOptions  # noqa: E402
from streamer.session import open_model  # noqa: E402
from streamer.synth.writer import Split, spec_for, write_model  # noqa: E402

FILES = [  # (label, preset, qtype, recipe, split, experts' gate and up merged, qwen3next's ssm_in split)
    ("Q8_0", "tiny-qwen35moe", "Q8_0", None, False, False, False),
    ("Q4_K_M", "tiny-qwen35moe", "Q8_0", "Q4_K_M", False, False, False),
    ("Q8_0 split", "tiny-qwen35moe", "Q8_0", None, True, False, False),
    ("Q4_K_M split", "tiny-qwen35moe", "Q8_0", "Q4_K_M", True, False, False),
    ("Q8_0 gate_up merged", "tiny-qwen35moe", "Q8_0", None, False, True, False),
    ("Q4_K_M gate_up merged", "tiny-qwen35moe", "Q8_0", "Q4_K_M", False, True, False),
    ("qwen3next Q8_0", "tiny-qwen3next", "Q8_0", None, False, False, False),
    ("qwen3next Q4_K_M", "tiny-qwen3next", "Q8_0", "Q4_K_M", False, False, False),
    ("qwen3next Q8_0 split", "tiny-qwen3next", "Q8_0", None, True, False, False),
    ("qwen3next Q8_0 attn_qkv", "tiny-qwen3next", "Q8_0", None, False, False, True),
    ("qwen3next Q4_K_M attn_qkv", "tiny-qwen3next", "Q8_0", "Q4_K_M", False, False, True),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="/tmp/hybrid_parity")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| file | stream-run vs ref: min cos / top-1 | llama.cpp vs ref: min cos / top-1 |")
    print("|---|---|---|")
    for label, preset, qtype, recipe, split, fused, split_in in FILES:
        name = label.replace(" ", "-")
        path = write_model(
            out / f"{name}.gguf",
            spec_for(preset, qtype, recipe=recipe, real_vocab=False, fuse_gate_up_exps=fused, split_ssm_in=split_in),
            split=Split(max_tensors=20) if split else Split(),
        )
        s = open_model(path, StreamOptions(stream=False, learn=False))
        ids = np.random.default_rng(1).integers(0, s.cfg.n_vocab, a.tokens)
        ours = s.model.forward(ids, s.model.new_state(), all_logits=True)[:-1]
        want = Reference(path).logits(ids)[:-1] if not split else None
        if split:  # the reference reads one file: the single file's (written first, the same weights)
            want = Reference(str(out / f"{name.replace('-split', '')}.gguf")).logits(ids)[:-1]
        np.save(out / "w.npy", ids[None].astype(np.int64))
        cmd = [a.llama_python, str(ROOT / "bench/llama_logits.py"), path, "--windows", str(out / "w.npy")]
        subprocess.run(cmd + ["--first", "0", "--out", str(out / "l.npy"), "--threads", "2"], check=True)
        theirs = np.load(out / "l.npy")[0]
        row = []
        for got in (ours, theirs):
            row.append(f"{cosines(got, want).min():.6f} / {(got.argmax(1) == want.argmax(1)).mean():.1%}")
        print(f"| {label} | {row[0]} | {row[1]} |", flush=True)


if __name__ == "__main__":
    main()
