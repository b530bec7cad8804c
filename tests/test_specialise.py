"""Kernels compiled per weight format (kernels/specialise.py): a model run compiles only its own formats'
specialisations, never the every-format version, and a second process loads them from numba's cache."""

import json
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from streamer.kernels import int8
from streamer.kernels.dispatch import SUPPORTED

# A fresh interpreter: open a model (its warm-up), prefill and decode; then every FormatKernel's signatures (its
# own and its specialisations') and the compile count of every dispatcher of the package.
SCRIPT = """
import importlib, json, pkgutil, sys
import numpy as np
from numba.core.registry import CPUDispatcher
import streamer.kernels as K
from streamer.kernels.specialise import FormatKernel
from streamer.options import StreamOptions
from streamer.session import open_model

disp = {}
for m in pkgutil.iter_modules(K.__path__):
    mod = importlib.import_module("streamer.kernels." + m.name)
    disp.update({n: v for n, v in vars(mod).items() if isinstance(v, CPUDispatcher) and v.__module__ == mod.__name__})
    for n, v in vars(mod).items():  # the per-instruction-set kernels (_bits.isa_kernels) live in dicts
        if isinstance(v, dict):
            disp.update({f"{n}[{k}]": d for k, d in v.items() if isinstance(d, CPUDispatcher) and d.__module__ == mod.__name__})
options = StreamOptions(learn=False, stream=False)
if sys.argv[2] == "streamed":  # a cache of twice the experts a token uses, as the demo streams its experts
    from streamer.config import ModelConfig
    from streamer.experts.store import ExpertLayout
    from streamer.gguf_file import GGUFFile

    gf = GGUFFile(sys.argv[1])
    cfg = ModelConfig.from_gguf(gf)
    options = StreamOptions(learn=False, expert_cache_bytes=2 * cfg.n_expert_used * ExpertLayout(gf, cfg).slot_bytes)
with open_model(sys.argv[1], options) as s:
    in_place = s.moe.source.in_place
    cache = s.model.new_state()
    s.model.forward(np.arange(1, 9), cache)
    s.model.forward(np.array([7]), cache)
    codes = sorted({m._fmt for m in s.model.matrices() + [s.model.embd]})
fk = {n: d for n, d in disp.items() if isinstance(d, FormatKernel)}
args = {}  # kernel -> the format arguments' types of each compiled signature
for n, d in fk.items():
    args[n] = [[str(sig[i]) for i in d.format_args] for sig in d.signatures]
every = [x for d in disp.values() for x in (d.dispatchers() if isinstance(d, FormatKernel) else [d])]
misses = sum(sum(d.stats.cache_misses.values()) for d in every)
quantize = [[str(t) for t in sig] for sig in K.int8.quantize_act.signatures]
print(json.dumps({"codes": codes, "args": args, "misses": misses, "quantize_act": quantize, "in_place": in_place}))
"""


def _run(path, mode="resident"):
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(path), mode], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["tiny-moe", pytest.param("tiny-qwen35moe", marks=pytest.mark.slow)])
def test_a_q8_0_model_compiles_only_q8_0_kernels(synth_model, preset):
    got = _run(synth_model(preset, "Q8_0"))
    assert SUPPORTED[T.Q8_0].fmt in got["codes"]
    compiled = {n: a for n, a in got["args"].items() if a}
    assert "block_matvec" in compiled and "experts_matvec" in compiled and "moe_block" in compiled, compiled
    # a hybrid's layers have no one-call attention block: attn_block is never compiled for it (it was, for every
    # format, when its empty list of format tuples read as "not given")
    assert ("attn_block" in compiled) == (preset == "tiny-moe"), compiled
    if int8.serves(SUPPORTED[T.Q8_0].fmt):  # the integer prefill matmul too (the Q8_0 attention matrices)
        assert f"KERNELS[{int8.ISA}]" in compiled, compiled
        # one quantize_act for both: the specialised matmul passes its group and offset as plain ints
        assert len(got["quantize_act"]) == 1 and "Literal" not in str(got["quantize_act"]), got["quantize_act"]
    # every compiled version has its format arguments as literals (no every-format version), and only this
    # model's codes (-1: moe_block's float router, which a block router never calls)
    for name, sigs in compiled.items():
        for fmts in sigs:
            assert all(f.startswith("Literal[int](") for f in fmts), (name, fmts)
            assert {int(f[len("Literal[int](") : -1]) for f in fmts} <= {-1, *got["codes"]}, (name, fmts)
    # a second process loads every one of them from numba's on-disk cache: nothing compiles
    again = _run(synth_model(preset, "Q8_0"))
    assert {n: sorted(set(map(tuple, a))) for n, a in again["args"].items() if a} == {
        n: sorted(set(map(tuple, a))) for n, a in compiled.items()
    }
    assert again["misses"] == 0


def test_a_streamed_moe_does_not_compile_the_resident_layer_block(synth_model):
    """moe_block serves a layer whose experts are all in place (MoEFFN.decode): a run streaming its experts
    through a cache, as the demo does, never calls it, so its first run does not compile it."""
    got = _run(synth_model("tiny-moe", "Q8_0"), "streamed")
    assert not got["in_place"]
    compiled = {n for n, a in got["args"].items() if a}
    assert "moe_block" not in compiled and "experts_matvec" in compiled, compiled


def test_warmup_without_a_model_takes_the_common_mixes():
    """`stream-run warmup` without a model compiles the demo's kernels and those of llama-quantize's Q4_K_M,
    Q5_K_M, Q6_K and Q8_0 files (their per-tensor types, synth/recipes.py), not every format tuple."""
    from streamer.kernels.experts import FORMATS as F
    from streamer.warmup import common_groups, recipe_formats

    qtypes, combos = recipe_formats()
    assert {T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0} <= qtypes <= {T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.F32}
    q4, q6 = F[T.Q4_K], F[T.Q6_K]
    assert {(q4, q4, q6, q4), (q4, q4, q4, q4)} <= set(combos["decode"])  # Q4_K_M: attn_v Q6_K on some layers
    assert {(q4, q4, q6), (q4, q4, q4)} <= set(combos["decode-ffn"])
    assert (-1, q4, q6) in combos["decode-moe"]  # a float router, Q4_K gate/up, Q6_K down experts
    assert sum(map(len, combos.values())) <= 24
    names = common_groups(qtypes)
    assert "int8" not in names and {"ops", "experts", "decode", "decode-moe"} <= set(names)


def test_an_empty_list_of_format_tuples_compiles_nothing():
    """A model without one-call decode blocks of a kind passes [] (decode_formats): nothing compiles, where None
    (`stream-run warmup` without a model) means every block format."""
    from streamer import warmup as W
    from streamer.kernels import decode

    kernels = (decode.attn_block, decode.ffn_block, decode.moe_block)
    before = W._misses(kernels), {k: dict(k.specs) for k in kernels}
    W._run_decode([])
    W._run_decode_ffn([])
    W._run_decode_moe([])
    assert (W._misses(kernels), {k: dict(k.specs) for k in kernels}) == before
