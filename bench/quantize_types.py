#!/usr/bin/env python
"""The per-tensor types llama-quantize gives tiny hybrid and MoE models, as a golden file for tests/test_recipes.py:
each file is written in F16 by `stream-run synth`, quantized by llama.cpp (llama-cpp-python's
llama_model_quantize, no importance matrix) to each recipe, and its tensors' types read back with gguf-py.

    python bench/quantize_types.py --llama-python /path/to/llama-venv/bin/python [--out tests/golden/quantize_types.json.gz]

Runs under the project's venv; llama.cpp runs in its own. The golden records llama.cpp's version.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import tempfile
from pathlib import Path

from gguf import GGUFReader, LlamaFileType

from streamer.synth.writer import spec_for, write_model

ROOT = Path(__file__).resolve().parent.parent
# (label, preset, layers, qwen3next's ssm_in split): 16 layers, so the first/last eighths and the every-third
# layers of use_more_bits are told apart from a count of 4
FILES = [
    ("qwen35moe", "tiny-qwen35moe", 16, False),
    ("qwen3next", "tiny-qwen3next", 16, False),
    ("qwen3next attn_qkv", "tiny-qwen3next", 16, True),
    ("qwen3moe", "tiny-moe", 16, False),
]
RECIPES = ["Q2_K", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]

QUANTIZE = """
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = ftype, 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--out", default=str(ROOT / "tests/golden/quantize_types.json.gz"))
    a = ap.parse_args()
    version = subprocess.run(
        [a.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    golden: dict = {"llama_cpp_python": version, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, preset, layers, split_in in FILES:
            spec = spec_for(preset, "F16", layers, real_vocab=False, split_ssm_in=split_in)
            src = write_model(os.path.join(tmp, "f16.gguf"), spec)
            entry = golden["files"][label] = {"preset": preset, "layers": layers, "split_ssm_in": split_in}
            for recipe in RECIPES:
                dst = os.path.join(tmp, f"{recipe}.gguf")
                ftype = str(LlamaFileType[f"MOSTLY_{recipe}"].value)
                subprocess.run([a.llama_python, "-c", QUANTIZE, src, dst, ftype], check=True, capture_output=True)
                entry[recipe] = {t.name: t.tensor_type.name for t in GGUFReader(dst).tensors}
                os.unlink(dst)
                print(f"{label} {recipe}: {len(entry[recipe])} tensors", flush=True)
    tmp_out = a.out + ".part"
    with gzip.open(tmp_out, "wt") as f:
        json.dump(golden, f, indent=0, sort_keys=True)
    os.replace(tmp_out, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
