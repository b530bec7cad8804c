"""Does a run whose kernels were just compiled give the bits of a run that loads them from numba's cache?

Runs `stream-run run MODEL --tokens ... --logits-out` three times on one empty NUMBA_CACHE_DIR: the first
compiles every kernel in its own process, the next two load them. Prints how the first run's logits differ
from the second's, and the second's from the third's (which must be equal).

    python bench/fresh_vs_cached.py MODEL.gguf [--tokens 3,77,120,9,201,45]

Seen on the Zen 3 VM (2026-12-03), tiny-moe Q4_K: all 2,286 logits differ, up to 6.6e-5 of the largest; the
two cached runs are equal. Kernel by kernel, blocks.block_matvec (Q4_K) gives different last bits compiled in
the process than loaded from the cache, while the same machine code rebuilt from its cache bytes inside the
compiling process gives the freshly compiled bits: what differs is which copy of the code the calls resolve to
(a library numba compiled on its own, or the copy linked into the kernel's cached object code).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def run(model: str, tokens: str, cache: str, out: Path) -> np.ndarray:
    cmd = [sys.executable, "-m", "streamer.cli.main", "run", model, "--tokens", tokens, "-n", "1"]
    p = subprocess.run(
        [*cmd, "--logits-out", str(out)], capture_output=True, text=True, env=dict(os.environ, NUMBA_CACHE_DIR=cache)
    )
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return np.load(out)


def compare(name: str, a: np.ndarray, b: np.ndarray) -> None:
    d = np.abs(a.astype(np.float64) - b)
    print(
        f"{name}: {int((a != b).sum())} of {a.size} logits differ, max |diff| {d.max():.3g} "
        f"({d.max() / np.abs(a).max():.3g} of the largest), argmax equal: {bool((a.argmax(-1) == b.argmax(-1)).all())}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", default="3,77,120,9,201,45")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "numba")
        fresh, cached, again = (run(a.model, a.tokens, cache, Path(tmp, f"{i}.npy")) for i in range(3))
    compare("compiled in the run vs loaded from the cache", fresh, cached)
    compare("loaded vs loaded", cached, again)


if __name__ == "__main__":
    main()
