"""`synth --recipe`: the per-tensor, per-layer types of the stock llama-quantize mixes, checked against tables
written out by hand from llama.cpp's src/llama-quant.cpp (llama_tensor_get_type_impl, no importance matrix),
against llama-quantize itself on tiny hybrid and MoE files (tests/golden/quantize_types.json.gz, written by
bench/quantize_types.py), and a tiny MoE in a mixed file run against the float64 reference, streamed == resident, with expert slots
sized for the largest layer and the budget counting every layer's real size."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, LlamaFileType
from reference import Reference

from streamer.buffers import ALIGN
from streamer.experts.store import ExpertLayout
from streamer.options import StreamOptions
from streamer.session import open_model
from streamer.synth.writer import spec_for, typed_tensors

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], dtype=np.int64)
# use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2
MORE_BITS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47}


QUANTIZED = json.load(gzip.open(Path(__file__).parent / "golden/quantize_types.json.gz", "rt"))["files"]


@pytest.mark.parametrize("label", sorted(QUANTIZED))
def test_recipes_give_what_llama_quantize_gives(label):
    """Every tensor's type, per recipe, as llama.cpp's llama_model_quantize chose it for the same F16 file (16
    layers: the hybrids' attn_qkv share attn_v's rules and count, which a count of layers would get wrong)."""
    f = QUANTIZED[label]
    recipes = [k for k in f if k not in ("preset", "layers", "split_ssm_in")]
    assert len(recipes) >= 8
    for recipe in recipes:
        spec = spec_for(
            f["preset"], recipe=recipe, layers=f["layers"], real_vocab=False, split_ssm_in=f["split_ssm_in"]
        )
        got = {name: qt.name for name, _, qt, _ in typed_tensors(spec, 381)}
        assert got == f[recipe], (recipe, {n: (got.get(n), t) for n, t in f[recipe].items() if got.get(n) != t})


def types_of(preset: str, recipe: str) -> dict[str, T]:
    return {n: qt for n, _, qt, _ in typed_tensors(spec_for(preset, recipe=recipe, real_vocab=False), 381)}


def expected_30b(recipe: str, i: int, part: str) -> T:
    """llama-quant.cpp's choice at the Qwen3-30B-A3B geometry (48 layers, 32/4 heads: n_gqa 8, 128 experts)."""
    base = {
        "Q2_K": T.Q2_K,
        "Q3_K_M": T.Q3_K,
        "Q4_K_M": T.Q4_K,
        "Q5_K_M": T.Q5_K,
        "IQ4_XS": T.IQ4_XS,
        "IQ2_XXS": T.IQ2_XXS,
        "IQ1_S": T.IQ1_S,
    }[recipe]
    if part == "attn_v":
        return {
            "Q2_K": T.Q4_K,
            "Q3_K_M": T.Q5_K if i < 2 else T.Q4_K,
            "IQ4_XS": T.Q5_K,
            "IQ2_XXS": T.Q4_K,
            "IQ1_S": T.Q4_K,
        }.get(recipe, T.Q6_K if i in MORE_BITS_48 else base)
    if part == "ffn_down_exps":
        return {
            "Q2_K": T.Q3_K,
            "Q3_K_M": T.Q5_K if i < 3 else T.Q4_K,
            "IQ4_XS": T.Q5_K if i < 6 else base,
            "IQ2_XXS": T.Q2_K if i < 6 else base,
            "IQ1_S": T.Q2_K if i < 6 else base,
        }.get(recipe, T.Q6_K if i in MORE_BITS_48 else base)
    if part == "attn_output":
        return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "IQ1_S": T.IQ2_XXS}.get(recipe, base)
    return base  # attn_q, attn_k, ffn_gate_exps, ffn_up_exps


@pytest.mark.parametrize("recipe", ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "IQ4_XS", "IQ2_XXS", "IQ1_S"])
def test_recipe_types_at_30b_a3b_geometry(recipe):
    got = types_of("qwen3-30b-a3b", recipe)
    assert got["output.weight"] == (T.Q5_K if recipe in ("IQ2_XXS", "IQ1_S") else T.Q6_K)
    assert got["token_embd.weight"] == {"IQ2_XXS": T.Q2_K, "IQ1_S": T.Q2_K}.get(recipe, expected_30b(recipe, 0, "q"))
    assert got["output_norm.weight"] == T.F32
    for i in range(48):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert got[f"blk.{i}.{part}.weight"] == expected_30b(recipe, i, part), (recipe, i, part)
        for part in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp"):  # never quantized
            assert got[f"blk.{i}.{part}.weight"] == T.F32


def test_conditions_on_heads_and_experts():
    # tiny-moe: 4/2 heads (n_gqa 2 < 4), 16 experts: Q2_K's attn_v upgrade needs n_gqa >= 4, the IQ2 one
    # n_gqa >= 4 or >= 4 experts; the dense tiny model has neither
    assert types_of("tiny-moe", "Q2_K")["blk.0.attn_v.weight"] == T.Q3_K
    assert types_of("tiny-moe", "IQ2_XXS")["blk.0.attn_v.weight"] == T.Q4_K
    assert types_of("tiny", "IQ2_XXS")["blk.0.attn_v.weight"] == T.Q2_K
    assert types_of("tiny", "IQ4_XS")["blk.0.attn_v.weight"] == T.IQ4_XS
    # tied embedding: token_embd takes the output's type
    tied = {n: qt for n, _, qt, _ in typed_tensors(spec_for("tiny", recipe="Q4_K_M", tied=True, real_vocab=False), 381)}
    assert "output.weight" not in tied and tied["token_embd.weight"] == T.Q6_K


def test_shape_fallback():
    from streamer.synth.recipes import recipe_types

    # rows of 96 (not a multiple of 256): Q4_K -> Q5_0, Q6_K -> Q8_0 (output: Q8_0), Q2_K/Q3_K -> Q4_0, IQ -> IQ4_NL
    ts = [
        ("token_embd.weight", (10, 96), T.F32),
        ("blk.0.attn_v.weight", (96, 96), T.F32),
        ("blk.0.ffn_down.weight", (96, 96), T.F32),
        ("output.weight", (10, 96), T.F32),
    ]
    assert recipe_types("Q4_K_M", ts, 1, 4, 1, 0) == [T.Q5_0, T.Q8_0, T.Q8_0, T.Q8_0]
    assert recipe_types("Q2_K", ts, 1, 4, 1, 0) == [T.Q4_0, T.Q5_0, T.Q4_0, T.Q8_0]
    assert recipe_types("IQ4_XS", ts, 1, 4, 1, 0) == [T.IQ4_NL, T.Q5_1, T.IQ4_NL, T.Q8_0]  # 1 layer: no Q5_K down


@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q3_K_M", "IQ2_XXS"])
def test_mixed_tiny_moe_matches_reference_and_streams_identically(synth_model, recipe):
    path = synth_model("tiny-moe", "Q8_0", recipe=recipe)
    r = GGUFReader(str(path))
    assert int(r.fields["general.file_type"].parts[-1][0]) == int(LlamaFileType[f"MOSTLY_{recipe}"])
    s = open_model(path, StreamOptions(stream=False, learn=False))
    layout = ExpertLayout(s.gf, s.cfg)
    per_layer = [
        sum(t.n_bytes for t in r.tensors if t.name.startswith(f"blk.{i}.") and "_exps" in t.name) // 16
        for i in range(4)
    ]
    if recipe == "Q4_K_M":  # use_more_bits(i, 4): layers 2 and 3 get Q6_K ffn_down_exps, so experts differ in size
        assert per_layer[2] > per_layer[0]
    assert [layout.expert_bytes(i) for i in range(4)] == per_layer
    assert layout.total_bytes == 16 * sum(per_layer)  # what the budget plan is given
    pages = [
        sum(
            -(-(t.n_bytes // 16 + ALIGN - 1) // ALIGN) * ALIGN
            for t in r.tensors
            if t.name.startswith(f"blk.{i}.") and "_exps" in t.name
        )
        for i in range(4)
    ]
    assert layout.slot_bytes == max(pages)  # one slot holds the largest layer's expert
    c = s.model.new_state()
    got = np.concatenate(
        [s.model.forward(PROMPT[:5], c, all_logits=True)]
        + [s.model.forward(PROMPT[i : i + 1], c, all_logits=True) for i in range(5, len(PROMPT))]
    )
    want = Reference(str(path)).logits(PROMPT)
    cos = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.999 and np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    st = open_model(path, StreamOptions(learn=False, expert_cache_bytes=5 * layout.slot_bytes))
    c = st.model.new_state()
    again = np.concatenate(
        [st.model.forward(PROMPT[:5], c, all_logits=True)]
        + [st.model.forward(PROMPT[i : i + 1], c, all_logits=True) for i in range(5, len(PROMPT))]
    )
    assert st.streaming and np.array_equal(again, got)
    st.close()


def test_cli_recipe(tmp_path):
    exe = Path(sys.executable).parent / "stream-run"
    r = subprocess.run(
        [str(exe), "synth", str(tmp_path / "a.gguf"), "--recipe", "Q4_K_M", "--qtype", "Q8_0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --recipe sets every tensor's type: give it without --qtype/--head-qtype"
    ]
    r = subprocess.run(
        [str(exe), "synth", str(tmp_path / "a.gguf"), "--recipe", "Q7_K"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stderr.startswith("error: unknown recipe 'Q7_K' (choose from ")
    r = subprocess.run(
        [str(exe), "synth", str(tmp_path / "a.gguf"), "--recipe", "IQ4_XS", "--preset", "tiny", "--vocab", "bytes"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    types = {t.name: t.tensor_type for t in GGUFReader(str(tmp_path / "a.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == T.IQ4_XS and types["output.weight"] == T.Q6_K
    assert types["blk.0.ffn_down.weight"] == T.IQ4_XS  # 2 layers: n/8 = 0, no Q5_K layer
