"""The start-up path of a one-off run: kernels left to load at their first call change no result, the
STREAM_RUN_TIMING line tells where the time went (and which kernels a prompt loaded), the fast exit keeps
what a run prints. Logits are compared with the warmed-up, resident path bit for bit (the float64 oracle
of both is tests/test_model.py's and test_moe.py's business)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from streamer.options import StreamOptions
from streamer.session import open_model

STREAM_RUN = Path(sys.executable).parent / "stream-run"
IDS = [3, 17, 5, 9, 30, 2, 11]


def _logits(path, options, lazy: bool) -> np.ndarray:
    with open_model(path, options, lazy_kernels=lazy) as s:
        cache = s.model.new_state()
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
    from gguf import GGMLQuantizationType as T

    from streamer.kernels import SUPPORTED, grouped, int8
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
    assert not names & {"grouped_gate_up", "grouped_down", "prepare_rows"} and not any(
        n.startswith("i8_") for n in names
    )
    # a five-token prompt prefills: the grouped kernels, and the integer matmul where the CPU has one
    five = _run(path, [5, 6, 7, 8, 9])
    assert five.returncode == 0, five.stderr
    t5 = json.loads([ln for ln in five.stderr.splitlines() if ln.startswith("timing: ")][0][len("timing: ") :])
    want = {grouped.grouped_gate_up.py_func.__name__, grouped.grouped_down.py_func.__name__}
    if int8.serves(SUPPORTED[T.Q8_0].fmt):  # the file is Q8_0: AVX2's integer kernel leaves it to the f32 tiles
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


# A fresh interpreter: open_model's own warm-up (the model's kernels only, not `stream-run warmup`'s all), then
# a prefill long enough that some expert gets more than grouped_max tokens (the integer grouped kernel) and
# two decode steps. Every numba dispatcher's signatures are listed after the warm-up and after the run.
PROMPT_SCRIPT = """
import importlib, json, pkgutil, sys
import numpy as np
from numba.core.registry import CPUDispatcher
import streamer.kernels as K
from streamer.options import StreamOptions
from streamer.session import open_model

disp = {}
for m in pkgutil.iter_modules(K.__path__):
    mod = importlib.import_module("streamer.kernels." + m.name)
    disp.update({n: v for n, v in vars(mod).items() if isinstance(v, CPUDispatcher) and v.__module__ == mod.__name__})
sigs = lambda: {k: sorted(map(str, d.signatures)) for k, d in disp.items() if d.signatures}
path, kw = json.loads(sys.argv[1])
with open_model(path, StreamOptions(learn=False, **kw)) as s:
    warm = sigs()
    cache = s.model.new_state()
    s.model.forward(np.arange(1, 25), cache)
    s.model.forward(np.array([7]), cache)
    s.model.forward(np.array([8]), cache)
print(json.dumps({"warm": warm, "after": sigs()}))
"""


@pytest.mark.parametrize(
    "preset,qtype,kw",
    [
        ("tiny-moe", "Q8_0", {"expert_cache_bytes": 1 << 20}),  # streamed, as the demo
        ("tiny-moe", "Q4_K", {"stream": False}),  # resident
        ("tiny-moe", "Q4_K", {"mmap": False}),  # a read-only copy in memory: the mapping's array types
        ("tiny", "Q4_K", {}),
    ],
)
def test_the_warm_up_compiles_what_the_first_prompt_needs(synth_model, preset, qtype, kw):
    """Nothing is compiled (or loaded) inside the first prompt: the warm-up gave every kernel the run calls
    the argument types the run passes. And it compiled nothing a run of this model never calls: a MoE has no
    dense-FFN decode block, and each kernel it calls one version per format tuple (one array type per argument;
    kernels/specialise.py compiles a kernel apart for each tuple of format codes, typed as literals)."""
    from streamer.kernels import decode
    from streamer.warmup import entry_points

    arg = json.dumps([str(synth_model(preset, qtype)), kw])
    p = subprocess.run([sys.executable, "-c", PROMPT_SCRIPT, arg], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    warm, after = got["warm"], got["after"]
    assert after == warm, {k: v for k, v in after.items() if warm.get(k) != v}
    assert (decode.ffn_block.__name__ in warm) == (preset == "tiny")
    called = {d.py_func.__name__ for d in entry_points()}  # (helpers they call take constants, e.g. group sizes)
    versions = {k: Counter(tuple(re.findall(r"Literal\[int\]\((-?\d+)\)", sig)) for sig in v) for k, v in warm.items()}
    assert {k: v for k, v in versions.items() if k in called and max(v.values()) > 1} == {}


def test_a_token_prompt_prints_what_the_built_tokenizer_decodes(synth_model):
    """`run --tokens` builds the tokenizer behind the prompt's forward (Session.tokenizer_in_background): what it
    prints, through the entry point's fast exit, is the greedy continuation decoded by a tokenizer built
    beforehand, prompt echo included, every byte of it."""
    if not STREAM_RUN.exists():
        pytest.skip(f"no console script at {STREAM_RUN}")
    from streamer.generate import Generator
    from streamer.sampler import Sampler, SamplerParams

    path = synth_model("tiny-moe", "Q8_0")
    ids = [5, 6, 7]
    with open_model(path, StreamOptions(learn=False), threads=1) as s:
        tok = s.tokenizer
        gen = Generator(s.model, s.model.new_state(), Sampler(SamplerParams(temperature=0.0)), tok.eog_ids)
        out = list(gen.generate(ids, 6))
        want = tok.decode(ids) + tok.decode(out) + "\n"
    cmd = [str(STREAM_RUN), "run", str(path), "--tokens", ",".join(map(str, ids)), "-n", "6", "-t", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    quiet = subprocess.run(cmd + ["--no-display-prompt"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stdout == tok.decode(out) + "\n"


def test_stop_ids_given_after_the_prompt_stop_the_first_token(synth_model):
    """Generator.stop_ids_after_prompt is asked once the prompt's forward is done (the KV cache holds the prompt),
    before the first token is sampled: a first token among them ends the generation at once, as stop_ids do."""
    from streamer.generate import Generator
    from streamer.sampler import Sampler, SamplerParams

    path = synth_model("tiny", "Q8_0")
    ids = [3, 17, 5]
    with open_model(path, StreamOptions(learn=False)) as s:
        greedy = Sampler(SamplerParams(temperature=0.0))
        first = next(Generator(s.model, s.model.new_state(), greedy).generate(ids, 1))
        seen = []

        def stop_ids() -> frozenset:
            seen.append(gen.state.n)
            return frozenset({first})

        gen = Generator(s.model, s.model.new_state(), greedy, stop_ids_after_prompt=stop_ids)
        assert list(gen.generate(ids, 4)) == [] and gen.stop_reason == "eog"
        assert seen == [len(ids)] and gen.stop_ids == frozenset({first}) and gen.stop_ids_after_prompt is None
        again = Generator(s.model, s.model.new_state(), greedy, stop_ids_after_prompt=lambda: frozenset())
        assert next(again.generate(ids, 4)) == first


def test_the_tokenizer_built_behind_is_the_tokenizer(synth_model, monkeypatch):
    """Session.tokenizer waits for tokenizer_in_background's thread and returns what it built; a build that
    failed there is built again, and its error raised, in the caller's thread."""
    from streamer.errors import StreamerError
    from streamer.tokenizer import Tokenizer

    path = synth_model("tiny", "Q8_0")
    with open_model(path, StreamOptions(learn=False)) as s:
        s.tokenizer_in_background()
        tok = s.tokenizer
        assert s._building is None and s.tokenizer is tok
        plain = Tokenizer.from_gguf(s.gf)
        assert tok.eog_ids == plain.eog_ids and tok.decode(range(40)) == plain.decode(range(40))
    calls = []

    def broken(gf):
        calls.append(gf)
        raise StreamerError("no vocabulary")

    monkeypatch.setattr(Tokenizer, "from_gguf", staticmethod(broken))
    with open_model(path, StreamOptions(learn=False)) as s:
        s.tokenizer_in_background()
        with pytest.raises(StreamerError, match="no vocabulary"):
            _ = s.tokenizer
        assert len(calls) == 2
