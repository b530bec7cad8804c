"""The start-up path of a one-off run: kernels left to load at their first call change no result, the
STREAM_RUN_TIMING line tells where the time went (and which kernels a prompt loaded), the fast exit keeps
what a run prints. Logits are compared with the warmed-up, resident path bit for bit (the float64 oracle
of both is tests/test_model.py's and test_moe.py's business)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from streamer.options import StreamOptions
from streamer.session import open_model

STREAM_RUN = Path(sys.executable).parent / "stream-run"
IDS = [3, 17, 5, 9, 30, 2, 11]


def _logits(path, options, lazy: bool) -> np.ndarray:
    with open_model(path, options, lazy_kernels=lazy) as s:
        cache = s.model.new_cache()
        first = s.model.forward(np.asarray(IDS), cache, all_logits=True)
        step = s.model.forward(np.asarray([7]), cache)
        return np.concatenate([first, step[None]])


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny"])
def test_lazy_kernels_change_no_logits(synth_model, preset):
    path = synth_model(preset, "Q4_K")
    resident = _logits(path, StreamOptions(learn=False, stream=False), lazy=False)
    if preset == "tiny-moe":  # streamed through a cache of a few experts, kernels loading lazily
        from streamer.config import ModelConfig
        from streamer.experts.store import ExpertLayout
        from streamer.gguf_file import GGUFFile

        gf = GGUFFile(path)
        slot = ExpertLayout(gf, ModelConfig.from_gguf(gf)).slot_bytes
        options = StreamOptions(learn=False, expert_cache_bytes=6 * slot)
    else:
        options = StreamOptions(learn=False)
    assert np.array_equal(_logits(path, options, lazy=True), resident)


def _run(path, ids, timing: bool = True):
    env = dict(os.environ)
    if timing:
        env.update(STREAM_RUN_TIMING="1", STREAM_RUN_T0=repr(time.time()))
    else:
        env.pop("STREAM_RUN_TIMING", None)
    cmd = [str(STREAM_RUN), "run", str(path), "--tokens", ",".join(map(str, ids)), "-n", "2", "-t", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_timing_line_and_the_kernels_a_prompt_loads(synth_model):
    if not STREAM_RUN.exists():
        pytest.skip(f"no console script at {STREAM_RUN}")
    from streamer.kernels import grouped, int8
    from streamer.warmup import cached, model_kernels

    path = synth_model("tiny-moe", "Q8_0")
    with open_model(path, StreamOptions(learn=False, stream=False)) as s:  # warms every kernel up: all cached
        assert cached(model_kernels(s.model, moe=True))
    t0 = time.time()
    one = _run(path, [5])
    wall = time.time() - t0
    assert one.returncode == 0, one.stderr
    lines = [ln for ln in one.stderr.splitlines() if ln.startswith("timing: ")]
    assert len(lines) == 1, one.stderr
    t = json.loads(lines[0][len("timing: ") :])
    # the entry point parses the header and starts reading before the CLI is loaded (cli/early.py)
    steps = ["header", "pagein_start", "cli", "input_checked", "kernels_imported", "model_built", "warmed_up"]
    assert [t[k] for k in steps] == sorted(t[k] for k in steps)  # the start-up path, in its order
    assert 0 < t["header"] <= t["first_token"] <= t["closed"] <= wall + 0.05
    assert t["early_pagein_bytes"] > 0 and "expert_demand_bytes" in t  # (0 here: every expert fits, in place)
    # a one-token prompt decodes: the prefill kernels (grouped experts, the integer matmul) never load
    names = set(t["kernels_loaded"])
    assert {"block_rows", "attn_block"} <= names and names & {"experts_matvec", "moe_block"}
    assert not names & {"grouped_gate_up", "grouped_down", "prepare_rows", "i8_matmul_vnni", "i8_matmul_generic"}
    # a five-token prompt prefills: the grouped kernels, and the integer matmul where the CPU has one
    five = _run(path, [5, 6, 7, 8, 9])
    assert five.returncode == 0, five.stderr
    t5 = json.loads([ln for ln in five.stderr.splitlines() if ln.startswith("timing: ")][0][len("timing: ") :])
    want = {grouped.grouped_gate_up.py_func.__name__, grouped.grouped_down.py_func.__name__}
    if int8.ISA is not None:
        want.add(int8.KERNELS[int8.ISA].py_func.__name__)
    assert want <= set(t5["kernels_loaded"])
    # the same text either way; without STREAM_RUN_TIMING no timing line
    plain = _run(path, [5, 6, 7, 8, 9], timing=False)
    assert plain.returncode == 0 and "timing:" not in plain.stderr
    assert plain.stdout == five.stdout and plain.stdout.strip()


def test_an_empty_kernel_cache_is_not_cached(tmp_path):
    """With nothing in numba's cache, run and chat warm up (compile, with the notice) as other commands do."""
    code = "from streamer.warmup import cached, entry_points; print(cached(entry_points()))"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-empty"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
