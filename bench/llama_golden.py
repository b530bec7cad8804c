#!/usr/bin/env python
"""Write tests/golden/llama_logits.npz: llama.cpp's per-position logits for tiny synthetic models.

Run with the project's Python (it writes the models with the project's own writer); llama.cpp runs in a
subprocess under the llama.cpp venv (bench/llama_run.py --logits-tokens), so nothing here or in the tests
imports llama-cpp-python:

    /opt/dev/bin/python bench/llama_golden.py [--llama-python /opt/llamavenv/bin/python] [--keep DIR]

Each model is written with fixed writer arguments and the byte vocabulary (so a logits row is a few hundred
floats wide), then llama.cpp evaluates TOKENS in one eval with logits_all=True (teacher forcing: every
position's logits given the true previous tokens, never free-running tokens), 2 threads, mmap, default
weight repacking. The .npz holds, per model: the writer arguments, the sha256 of the model file and of its
tensor data, and llama.cpp's float32 logits; plus the tokens and llama.cpp's version.
tests/test_golden.py rebuilds each model from the recorded arguments, checks the sha256, and compares.
Re-run this script whenever the writer's output changes (the test says so when it sees a different sha256).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "llama_logits.npz"
LLAMA_RUN = Path(__file__).resolve().parent / "llama_run.py"
DEFAULT_LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON", "/opt/llamavenv/bin/python")

# Byte-vocabulary ids: 0..255 are the raw bytes, 256.. are merges, the last five the Qwen3 specials.
# ASCII text plus a few merge ids: 32 positions (attention over a real context, small to store).
TOKENS = list(b"The quick brown fox jumps") + [256, 262, 270, 280, 290, 300, 32]
assert len(TOKENS) == 32

# name -> spec_for(preset, qtype, layers=None, **kw) arguments. Fixed seeds; byte vocabulary.
MODELS: dict[str, dict] = {
    "tiny_q8_0": dict(preset="tiny", qtype="Q8_0", tied=False, seed=11),
    "tiny_q4_k": dict(preset="tiny", qtype="Q4_K", tied=False, seed=12),
    "tiny_q6_k_tied": dict(preset="tiny", qtype="Q6_K", tied=True, seed=13),
    "tiny_moe_q8_0": dict(preset="tiny-moe", qtype="Q8_0", tied=False, seed=14),
    "tiny_moe_q4_k": dict(preset="tiny-moe", qtype="Q4_K", tied=False, seed=15),
}


def sha256_file(path, start: int = 0) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return hashlib.file_digest(f, "sha256").hexdigest()


def tensor_data_offset(path) -> int:
    import gguf

    return int(gguf.GGUFReader(path).data_offset)


def write(path, args: dict) -> str:
    from streamer.synth.writer import spec_for, write_model

    a = dict(args)
    return write_model(path, spec_for(a.pop("preset"), a.pop("qtype"), a.pop("layers", None), real_vocab=False, **a))


def llama_logits(llama_python: str, model, tokens) -> tuple[np.ndarray, dict]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.npy")
        cmd = [
            llama_python,
            str(LLAMA_RUN),
            str(model),
            "--threads",
            "2",
            "--logits-tokens",
            ",".join(map(str, tokens)),
            "--logits-out",
            out,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"llama.cpp failed on {model}:\n{p.stderr[-3000:]}")
        info = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
        return np.load(out), info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-python",
        default=DEFAULT_LLAMA_PYTHON,
        help="Python with llama-cpp-python (default $LLAMA_PYTHON or /opt/llamavenv/bin/python)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", type=Path, help="keep the written models in this directory")
    args = ap.parse_args(argv)

    arrays: dict[str, np.ndarray] = {"tokens": np.asarray(TOKENS, np.int32)}
    meta: dict = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "script": "bench/llama_golden.py",
        "tokens": TOKENS,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        d = args.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        for name, wargs in MODELS.items():
            path = d / f"{name}.gguf"
            write(path, wargs)
            logits, info = llama_logits(args.llama_python, path, TOKENS)
            assert logits.shape == (len(TOKENS), info["n_vocab"]) and np.isfinite(logits).all(), name
            meta["llama"] = {
                "versions": info["versions"],
                "n_threads": info["n_threads"],
                "use_mmap": info["use_mmap"],
                "logits_all": True,
                "one_eval": True,
            }
            meta["models"][name] = {
                "writer_args": {**wargs, "real_vocab": False},
                "sha256": sha256_file(path),
                "tensor_data_sha256": sha256_file(path, tensor_data_offset(path)),
                "file_bytes": os.path.getsize(path),
                "n_vocab": info["n_vocab"],
                "llama_repack": info["use_extra_bufts"],
                "llama_load_log": [ln for ln in info["load_log"] if "REPACK" in ln or "repack" in ln][:3],
            }
            arrays[f"{name}.logits"] = logits.astype(np.float32)
            print(f"{name}: {path.stat().st_size / 1e6:.2f} MB, logits {logits.shape}", file=sys.stderr)
    arrays["meta_json"] = np.array(json.dumps(meta, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".part.npz")
    np.savez_compressed(tmp_out, **arrays)
    os.replace(tmp_out, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
