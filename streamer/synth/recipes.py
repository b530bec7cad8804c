"""The stock llama-quantize mixes: which type each tensor of a Qwen3 / Qwen3-MoE model gets for a file type
such as Q4_K_M, transcribed from llama.cpp's src/llama-quant.cpp (llama_tensor_get_type_impl, the shape
fallback of tensor_type_fallback, and which tensors are quantized at all), without an importance matrix.

The rules that matter for these models:
- output.weight (or a tied token_embd): Q6_K (Q5_K for the IQ1/IQ2 mixes), Q8_0 if rows do not fit its blocks;
- token_embd: the base type (Q2_K for IQ2_XXS/IQ2_XS/IQ1_S/IQ1_M, IQ3_S for IQ2_S/IQ2_M/IQ3_XXS);
- attn_v, ffn_down(_exps), attn_output (and attn_k, attn_q for some IQ3 mixes) get more bits on some layers:
  use_more_bits(i, n) is i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2; attn_v's i and n count the attn_v and
  attn_qkv tensors (the hybrids' linear-attention q/k/v takes attn_v's rules);
- norms (1-D) and the router ffn_gate_inp stay as they are (F32).
Layer counters run in file order, as llama-quantize walks the tensors.
"""

from __future__ import annotations

from gguf import LlamaFileType as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

BASE = {
    "Q4_0": T.Q4_0,
    "Q4_1": T.Q4_1,
    "Q5_0": T.Q5_0,
    "Q5_1": T.Q5_1,
    "Q8_0": T.Q8_0,
    "Q2_K": T.Q2_K,
    "Q2_K_S": T.Q2_K,
    "Q3_K_S": T.Q3_K,
    "Q3_K_M": T.Q3_K,
    "Q3_K_L": T.Q3_K,
    "Q4_K_S": T.Q4_K,
    "Q4_K_M": T.Q4_K,
    "Q5_K_S": T.Q5_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "IQ2_XXS": T.IQ2_XXS,
    "IQ2_XS": T.IQ2_XS,
    "IQ2_S": T.IQ2_S,
    "IQ2_M": T.IQ2_S,
    "IQ3_XXS": T.IQ3_XXS,
    "IQ3_XS": T.IQ3_S,
    "IQ3_S": T.IQ3_S,
    "IQ3_M": T.IQ3_S,
    "IQ1_S": T.IQ1_S,
    "IQ1_M": T.IQ1_M,
    "IQ4_NL": T.IQ4_NL,
    "IQ4_XS": T.IQ4_XS,
    "MXFP4_MOE": T.MXFP4,
}
RECIPES = tuple(BASE)
_IQ12 = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
_FALLBACK = {
    T.IQ1_S: T.IQ4_NL,
    T.IQ1_M: T.IQ4_NL,
    T.IQ2_XXS: T.IQ4_NL,
    T.IQ2_XS: T.IQ4_NL,
    T.IQ2_S: T.IQ4_NL,
    T.IQ3_XXS: T.IQ4_NL,
    T.IQ3_S: T.IQ4_NL,
    T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0,
    T.Q3_K: T.Q4_0,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}


def file_type(recipe: str) -> F:
    """The general.file_type llama-quantize writes for the recipe."""
    return F[f"MOSTLY_{recipe}"]


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: T, n_cols: int) -> T:
    """tensor_type_fallback: a type whose blocks do not divide the row length is replaced."""
    if n_cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    alt = _FALLBACK.get(qtype, T.F16)
    return alt if n_cols % GGML_QUANT_SIZES[alt][0] == 0 else T.F16


class _State:
    def __init__(self, n_layer: int, n_head: int, n_head_kv: int, n_expert: int, has_output: bool, n_wv: int):
        self.n_layer, self.n_gqa, self.n_expert, self.has_output = n_layer, n_head // n_head_kv, n_expert, has_output
        self.n_attention_wv = n_wv  # attn_v-like tensors in the file: attn_v and attn_qkv (one per layer in qwen3moe)
        self.i_attention_wv = self.i_ffn_down = 0


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    if "attn_qkv.weight" in name:  # llama-quant's category_is_attn_v: a fused q/k/v takes attn_v's rules and count
        return "attn_v"
    for key in (
        "attn_v.weight",
        "attn_k.weight",
        "attn_q.weight",
        "attn_output.weight",
        "ffn_up",
        "ffn_gate",
        "ffn_down",
    ):
        if key in name:
            return key.removesuffix(".weight")
    return "other"


def _rule(q: _State, r: str, new: T, name: str, shape: tuple[int, ...]) -> T:
    cat = _category(name)
    if cat == "output" or (not q.has_output and cat == "token_embd"):
        return _output(r, new, shape)
    if r == "MXFP4_MOE":
        return T.MXFP4 if len(shape) == 3 and shape[0] > 1 else T.Q8_0
    if cat == "token_embd":
        if r in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return T.Q2_K
        if r in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return T.IQ3_S
        return new
    if r in _IQ12:
        return _iq12(q, r, new, cat)
    if cat == "attn_v":
        return _attn_v(q, r, new)
    if cat == "attn_k":
        if q.n_expert == 8:
            return T.Q8_0
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(r, new)
    if cat == "attn_q":
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(r, new)
    if cat == "ffn_down":
        q.i_ffn_down += 1
        return _ffn_down(q, r, new, _layer(name))
    if cat == "attn_output":
        if q.n_expert == 8:
            return T.Q5_K if r in _ATTN_OUTPUT_Q5_K_8_EXPERTS else new
        return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(r, new)
    if cat in ("ffn_gate", "ffn_up"):
        i, n = _layer(name), q.n_layer
        if r == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            return T.IQ3_XXS
    return new


# attn_output of an 8-expert model takes Q5_K in these recipes
_ATTN_OUTPUT_Q5_K_8_EXPERTS = frozenset(
    {"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M", "IQ4_XS"}
)


def _output(r: str, new: T, shape: tuple[int, ...]) -> T:
    """The output matrix (or the embedding that stands in for it)."""
    if r == "MXFP4_MOE" or shape[-1] % GGML_QUANT_SIZES[new][0]:
        return T.Q8_0
    if r in _IQ12 or r == "IQ3_XXS":
        return T.Q5_K
    return T.Q6_K if new != T.Q8_0 else new


def _iq12(q: _State, r: str, new: T, cat: str) -> T:
    """The 1- and 2-bit IQ recipes' exceptions (llama-quant's first branch for them)."""
    if cat == "attn_v":
        q.i_attention_wv += 1
        if q.n_gqa >= 4 or q.n_expert >= 4:
            return T.Q4_K
        return T.IQ3_S if r in ("IQ2_S", "IQ2_M") else T.Q2_K
    if q.n_expert == 8 and cat == "attn_k":
        return T.Q4_K
    if cat == "ffn_down":
        i = q.i_ffn_down
        q.i_ffn_down += 1
        if i < q.n_layer // 8:
            return T.IQ3_S if r in ("IQ2_S", "IQ2_M") else T.Q2_K
        return new
    if cat == "attn_output":
        if q.n_expert == 8:
            return T.Q5_K
        if r in ("IQ1_S", "IQ1_M"):
            return T.IQ2_XXS
        if r in ("IQ2_S", "IQ2_M"):
            return T.IQ3_S
    return new


def _attn_v(q: _State, r: str, new: T) -> T:
    i = q.i_attention_wv
    q.i_attention_wv += 1
    if r == "Q2_K":
        new = T.Q4_K if q.n_gqa >= 4 else T.Q3_K
    elif r == "Q2_K_S" and q.n_gqa >= 4:
        new = T.Q4_K
    elif r == "IQ3_XXS":
        new = T.Q4_K if q.n_gqa >= 4 else T.IQ3_S  # IQ3_S without an importance matrix
    elif r in ("IQ3_XS", "IQ3_S") and q.n_gqa >= 4:
        new = T.Q4_K
    elif r == "IQ3_M":
        new = T.Q4_K
    elif r == "Q3_K_M":
        new = T.Q5_K if i < 2 else T.Q4_K
    elif r == "Q3_K_L":
        new = T.Q5_K
    elif r in ("IQ4_NL", "IQ4_XS") and q.n_gqa >= 4:
        new = T.Q5_K
    elif r in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, q.n_attention_wv):
        new = T.Q6_K
    elif r == "Q4_K_S" and i < 4:
        new = T.Q5_K
    return T.Q8_0 if q.n_expert == 8 else new


def _ffn_down(q: _State, r: str, new: T, i: int) -> T:
    """ffn_down of layer i (the recipes outside _IQ12)."""
    n = q.n_layer
    if r == "Q2_K":
        return T.Q3_K
    if r == "Q2_K_S":
        return T.Q4_K if i < n // 8 else new
    if r == "IQ3_XXS":
        return T.Q4_K if i < n // 8 else T.Q3_K  # without an importance matrix
    if r == "Q3_K_M":
        return T.Q5_K if i < n // 16 else T.Q4_K
    if r == "IQ3_M" and (i < n // 8 or (q.n_expert == 8 and use_more_bits(i, n))):
        return T.Q4_K
    if r == "Q3_K_L":
        return T.Q5_K
    if r == "Q4_K_M":
        return T.Q6_K if use_more_bits(i, n) else new
    if i < n // 8 and r in ("IQ4_NL", "IQ4_XS"):
        return T.Q5_K
    if r == "Q5_K_M" and use_more_bits(i, n):
        return T.Q6_K
    if r == "Q4_K_S" and i < n // 8:
        return T.Q5_K
    return new


def recipe_types(recipe: str, tensors, n_layer: int, n_head: int, n_head_kv: int, n_expert: int) -> list[T]:
    """The type of each tensor, given in file order as (name, numpy shape, type it would have unquantized):
    1-D tensors and the router keep theirs, every other weight gets the recipe's choice."""
    base = BASE[recipe]
    has_output = any(name == "output.weight" for name, _, _ in tensors)
    n_wv = sum(_category(name) == "attn_v" for name, shape, _ in tensors if len(shape) >= 2)
    q = _State(n_layer, n_head, n_head_kv, n_expert, has_output, n_wv)
    out = []
    for name, shape, source in tensors:
        if len(shape) < 2 or "ffn_gate_inp" in name or "_norm" in name or "ssm_conv1d" in name:  # as llama-quantize
            out.append(source)
            continue
        out.append(_fallback(_rule(q, recipe, base, name, shape), shape[-1]))
    return out
