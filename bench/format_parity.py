"""Logits parity of every added weight format, recipe mix and split file: stream-run and llama.cpp, each
against the float64 reference (tests/reference.py over gguf-py's dequantizer), under teacher forcing.

    python bench/format_parity.py [--dir /tmp/format-parity] [--llama-python /opt/llamavenv/bin/python]

Writes tiny synthetic models (tiny-moe and tiny-qwen2 geometry, byte vocabulary) into --dir: one per format,
one per recipe, split sets (next to a single-file copy for the reference), then runs `stream-run run --tokens
... --logits-out` and llama.cpp (llama-cpp-python, which loads a split set from its first shard; n_threads 1,
logits_all) on the same token sequence, and prints one JSON line per model: the largest |logit - reference|
of each tool, relative to the reference's largest |logit|. Correctness only (no timing); never run in CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TOKENS = [3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64, 7, 300, 11, 250]
from test_formats import NEW as FORMATS  # noqa: E402  (the block formats of streamer/formats.py the tests run)

RECIPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "IQ4_XS", "IQ2_XXS", "IQ1_S"]
LLAMA = """
import sys
import numpy as np
import llama_cpp
path, toks, out = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3]
m = llama_cpp.Llama(path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, verbose=False, n_threads=1, seed=0)
m.eval(toks)
np.save(out, np.array(m.scores[:len(toks)], dtype=np.float32))
"""


def models(root: Path):
    """(name, path to open, single-file path for the reference)."""
    from streamer.synth.writer import Split, spec_for, write_model

    def make(name, preset, qtype="Q8_0", split=None, **kw):
        spec = spec_for(preset, qtype, real_vocab=False, **kw)
        (root / name).mkdir(parents=True, exist_ok=True)
        single = write_model(root / name / "single.gguf", spec)
        first = write_model(root / name / "m.gguf", spec, split=split) if split else single
        return name, first, single

    yield make("split-Q8_0", "tiny-moe", split=Split(max_size=3 << 19))
    yield make("split-Q8_0-no-tensor-first", "tiny-moe", split=Split(max_tensors=5, small_first=True))
    for q in FORMATS:
        yield make(f"moe-{q}", "tiny-moe", q)
    for r in RECIPES:
        yield make(f"recipe-{r}", "tiny-moe", recipe=r)
    yield make("recipe-Q3_K_M-split", "tiny-moe", recipe="Q3_K_M", split=Split(max_size=1 << 20))
    yield make("qwen2-Q8_0", "tiny-qwen2")
    yield make("qwen2-Q4_K-tied", "tiny-qwen2", "Q4_K", tied=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/format-parity"))
    ap.add_argument("--llama-python", default="/opt/llamavenv/bin/python")
    args = ap.parse_args()
    from reference import Reference

    toks = ",".join(map(str, TOKENS))
    exe = Path(sys.executable).parent / "stream-run"
    for name, path, single in models(args.dir):
        want = Reference(str(single)).logits(np.array(TOKENS))
        scale = float(np.abs(want).max())
        row: dict = {"model": name}
        for tool, cmd in (
            ("stream-run", [str(exe), "run", str(path), "--tokens", toks, "--no-stream", "--logits-out"]),
            ("llama.cpp", [args.llama_python, "-c", LLAMA, str(path), toks]),
        ):
            out = args.dir / name / f"{tool}.npy"
            r = subprocess.run(cmd + [str(out)], capture_output=True, text=True)
            if r.returncode:
                row[tool] = "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]
            else:
                row[tool] = round(float(np.abs(np.load(out) - want).max()) / scale, 6)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
