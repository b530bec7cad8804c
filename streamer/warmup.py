"""Compile every kernel ahead of time (`stream-run warmup`), or load it from numba's on-disk cache.

Each group runs its kernels once on tiny zero inputs: the QMatrix kernels of each set of GGML types sharing kernels,
the forward pass's ops, the multi-expert decode kernels, and the int8 prefill matmul for each instruction set the CPU
runs. numba finds a cached version again only for the same argument types, so the inputs here have exactly the types
a model run passes: weights read-only and C-contiguous, activations float32 and C-contiguous, Python ints and floats
for the scalars (tests/test_first_run.py checks that a model run afterwards compiles nothing new)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGMLQuantizationType as T

from streamer.kernels import blocks, decode, experts, grouped, int8, lanes, ops, recurrent, routing
from streamer.kernels.dispatch import INT8, SUPPORTED, QMatrix
from streamer.kernels.gemm import TILE
from streamer.kernels.specialise import FormatKernel, Specialised
from streamer.synth.writer import PRESETS, SynthSpec, typed_tensors

N_IN = 256  # a multiple of every block size (32 and 256 elements)
N_OUT = 4


class Group(NamedTuple):
    name: str
    kernels: tuple  # the numba dispatchers the group compiles
    run: Callable[[], None]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _matrix_group(qtypes: list[T]) -> Group:
    """The QMatrix kernels one set of formats shares (they take the format as an argument), run per format."""
    k = SUPPORTED[qtypes[0]]

    def run() -> None:
        for qtype in qtypes:
            block, type_size = GGML_QUANT_SIZES[qtype]
            m = QMatrix(np.zeros((N_OUT, N_IN // block * type_size), np.uint8), qtype, N_IN, f"warmup-{qtype.name}")
            m.matvec(np.zeros(N_IN, np.float32))
            m.matmul(np.zeros((2, N_IN), np.float32))
            m.rows(np.zeros(1, np.int64))

    return Group("/".join(t.name for t in qtypes), (k.matvec, k.matmul, k.rows), run)


def _matrix_groups(qtypes=None) -> list[Group]:
    shared: dict = {}  # matvec kernel -> the formats it serves (of qtypes, if given), in SUPPORTED's order
    for qtype, k in SUPPORTED.items():
        if qtypes is None or qtype in qtypes:
            shared.setdefault(k.matvec, []).append(qtype)
    return [_matrix_group(qtypes) for qtypes in shared.values()]


def _run_ops() -> None:
    n_embd, n_head, n_kv, head_dim, n_ctx = 64, 2, 1, 16, 4
    norm = _readonly(np.ones(n_embd, np.float32))  # norm weights are F32 views of the read-only mapping
    head_norm = _readonly(np.ones(head_dim, np.float32))
    cos, sin = ops.rope_tables(n_ctx, head_dim, 1e6)
    kc = np.zeros((n_kv, n_ctx, head_dim), np.uint16)  # one layer of the f16 KV cache
    for m in (2, 1):
        x = np.zeros((m, n_embd), np.float32)
        ops.rmsnorm(x, norm, 1e-6, x)
        q = np.zeros((m, n_head, head_dim), np.float32)
        ops.head_norm_rope(q, head_norm, 1e-6, cos, sin, 0)
        ops.head_rope(q, cos, sin, 0)  # Qwen2: RoPE without the per-head norm
        ops.attention(q, kc, kc, 0, np.float32(0.25), np.empty_like(q))
        kv = np.zeros((m, n_kv, head_dim), np.float32)
        ops.store_kv(kv, kv, kc, kc, 0)
        ops.swiglu(x, x, x)
        ops.swiglu_rows(x, x, x)


def _run_recurrent() -> None:
    """A hybrid model's linear-attention kernels (kernels/recurrent.py) with the argument types Gated DeltaNet
    passes: weights as read-only views of the mapping, state and activations as writable float32."""
    n_embd, d, n_k, n_v, K = 64, 16, 1, 2, 4
    C = (2 * n_k + n_v) * d
    conv = np.zeros((K - 1, C), np.float32)
    S = np.zeros((n_v, d, d), np.float32)
    for m in (2, 1):
        x = np.zeros((m, C), np.float32)
        recurrent.conv_silu(x, _readonly(np.zeros((C, K), np.float32)), conv, conv.copy(), np.empty_like(x))
        o, ba = np.zeros((m, n_v * d), np.float32), np.zeros((m, n_v), np.float32)
        vec = _readonly(np.zeros(n_v, np.float32))
        recurrent.delta_rule(x, ba, ba, vec, vec, n_k, 0, np.float32(1e-6), S, S.copy(), o)
        recurrent.gated_rmsnorm(o, o, _readonly(np.ones(d, np.float32)), 1e-6, o)
        recurrent.sigmoid_gate(np.zeros((m, n_embd), np.float32), np.zeros((m, n_embd), np.float32))


def _formats(qtypes) -> list:
    """(qtype, format code) of the multi-expert kernels' formats, or of those among qtypes."""
    return [(q, f) for q, f in experts.FORMATS.items() if qtypes is None or q in qtypes]


def _run_experts(qtypes=None) -> None:
    """Both multi-expert kernels for every format they handle (one compiled version serves all: the format
    is a runtime argument), over a read-only flat byte array as MoEFFN passes them; qtypes: only these formats
    (a model's own: a run then loads the same kernels, and skips calls that cost a parallel launch each)."""
    k = 2
    for qtype, fmt in _formats(qtypes):
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = N_IN // block * type_size
        w = _readonly(np.zeros(k * N_OUT * row_bytes, np.uint8))
        offs = np.arange(k, dtype=np.int64) * (N_OUT * row_bytes)
        sx = experts.ExpertScratch(1, N_IN)
        out = np.empty((k, N_OUT), np.float32)
        experts.experts_matvec(fmt, w, offs, row_bytes, np.zeros(N_IN, np.float32), out, sx.xq[0], sx.aux[0])
        sa = experts.ExpertScratch(k, N_IN)
        experts.experts_down(
            fmt,
            w,
            offs,
            row_bytes,
            np.zeros((k, N_IN), np.float32),
            np.ones(k, np.float32),
            np.zeros(N_OUT, np.float32),
            sa.xq,
            sa.aux,
        )
        m, g = 3, 2  # the grouped prefill kernels: m tokens over g experts, one pair each
        xq, aux = blocks.act_buffer(N_IN, m), np.empty((m, 3 * (N_IN >> 5) + 1), np.float32)
        grouped.prepare_rows(fmt, np.zeros((m, N_IN), np.float32), xq, aux)
        starts, toks = np.arange(g + 1, dtype=np.int64), np.arange(g, dtype=np.int64)
        gu = np.empty((2, g, N_OUT), np.float32)
        grouped.grouped_gate_up(fmt, w, np.zeros((2, g), np.int64), row_bytes, xq, aux, starts, toks, gu)
        grouped.grouped_down(
            fmt,
            w,
            np.zeros(g, np.int64),
            starts,
            row_bytes,
            np.zeros((g, N_IN), np.float32),
            blocks.act_buffer(N_IN, g),
            np.empty((g, 3 * (N_IN >> 5) + 1), np.float32),
            np.ones(g, np.float32),
            np.array([0, 1, 2, 2], np.int64),
            toks,
            np.zeros((m, N_OUT), np.float32),
        )
        gu = np.empty((2, g, N_IN), np.float32)
        tstarts = np.array([0, 1, 2, 2], np.int64)
        grouped.scatter_add(np.zeros((m, N_IN), np.float32), gu[0], np.ones(g, np.float32), tstarts, toks)
    for m in (1, 2):  # the router's top-k (Router.predict and one token: m = 1; prefill: more)
        routing.topk_softmax(np.zeros((m, 8), np.float32), 2, np.empty((m, 2), np.int64), np.empty((m, 2), np.float32))


def _decode_args():
    """Tiny arguments of kernels/decode.py's attention and dense-FFN blocks, with the types Model._decode_args
    passes. The rows are Q8_0's size, the largest of the block formats per element: they serve every format
    (each format's kernel is compiled apart, specialise.py)."""
    n, nh, nkv, hd, n_ctx = N_IN, 2, 1, N_IN // 2, 4
    rb = N_IN // 32 * 34
    w = _readonly(np.zeros((n, rb), np.uint8))  # every matrix n x n here
    norm, none = _readonly(np.ones(n, np.float32)), _readonly(np.empty(0, np.float32))
    head_norm = _readonly(np.ones(hd, np.float32))
    cos, sin = ops.rope_tables(n_ctx, hd, 1e6)
    kc = np.zeros((1, nkv, n_ctx, hd), np.uint16)[0]  # one layer of the cache
    qkv = np.zeros((nh + 2 * nkv) * hd, np.float32)
    q, kv = qkv[: nh * hd].reshape(1, nh, hd), qkv[nh * hd : (nh + nkv) * hd].reshape(1, nkv, hd)
    s3, s1 = experts.ExpertScratch(3, n), experts.ExpertScratch(1, n)  # the buffers Model._decode_args makes
    xq, aux, x1, aux1 = s3.xq, s3.aux, s1.xq[0], s1.aux[0]
    x, h = np.zeros((1, n), np.float32), np.zeros((1, n), np.float32)
    wq = _readonly(np.zeros((nh * hd, rb), np.uint8))
    wkv = _readonly(np.zeros((nkv * hd, rb), np.uint8))
    return SimpleNamespace(**locals())


def _uniform(n: int) -> list[tuple[int, ...]]:
    """Every block format for all n format arguments (what `stream-run warmup` compiles of the decode blocks)."""
    return [(f,) * n for f in experts.FORMATS.values()]


def _run_decode(combos=None) -> None:
    """decode.attn_block (every model whose matrices are block-quantized: Model.decodes_in_blocks), for each
    (fq, fk, fv, fo) of combos (a model's own: decode_formats)."""
    a = _decode_args()
    nq, nk = a.nh * a.hd, a.nkv * a.hd
    for fq, fk, fv, fo in _uniform(4) if combos is None else combos:  # [] (a model without these blocks): none
        for bias, qn in ((a.none, a.head_norm), (a.norm[:nq], a.none)):  # Qwen3, and Qwen2's biases without norms
            w = decode.AttnWeights(a.norm, a.norm, 1e-6, a.wq, bias, a.wkv, bias[:nk], a.wkv, bias[:nk], qn, qn,
                                   a.cos, a.sin, np.float32(0.1), a.w)  # fmt: skip
            att = np.empty((1, a.nh, a.hd), np.float32)
            scratch = decode.AttnScratch(a.qkv, a.q, a.kv, a.kv, att, a.xq, a.aux, a.x1, a.aux1)
            decode.attn_block(a.x, a.h, 0, a.kc, a.kc, fq, fk, fv, fo, tuple(w), tuple(scratch))


def _run_decode_ffn(combos=None) -> None:
    """decode.ffn_block: the dense FFN of one token (dense models only; a MoE's FFN is moe_block or MoEFFN's),
    for each (fg, fu, fd) of combos."""
    a = _decode_args()
    scratch = decode.FFNScratch(np.empty((2, a.n), np.float32), a.xq, a.aux, a.x1, a.aux1)
    for fg, fu, fd in _uniform(3) if combos is None else combos:
        decode.ffn_block(a.x, a.h, fg, fu, fd, a.w, a.w, a.w, tuple(scratch))


def _run_decode_moe(combos=None) -> None:
    """decode.moe_block with moe_compute.WholeLayer's argument types, for each (fr, fgu, fd) of combos (fr -1: a float
    router, whose logits the caller computes)."""
    every = [c for f, *rest in _uniform(3) for c in ((f, *rest), (-1, *rest))]
    for combo in every if combos is None else combos:
        _decode_moe(*combo)


def _decode_moe(fr: int, fgu: int, fd: int) -> None:
    n, k, n_exp = N_IN, 2, 4
    rb = N_IN // 32 * 34
    x, h = np.zeros((1, n), np.float32), np.zeros((1, n), np.float32)
    s1, sk = experts.ExpertScratch(1, n), experts.ExpertScratch(k, n)  # moe_compute.Fused's scratch_x, scratch_a
    x1, aux1 = s1.xq[0], s1.aux[0]
    base = _readonly(np.zeros(3 * n_exp * n * rb, np.uint8))
    starts, sizes = np.arange(3, dtype=np.int64) * (n_exp * n * rb), np.full(3, n * rb, np.int64)
    ex = decode.MoEExperts(base, starts, sizes, rb, rb)
    scratch = decode.MoEScratch(np.zeros((1, n_exp), np.float32), x1, aux1, np.empty((1, k), np.int64),
                                np.empty((1, k), np.float32), np.empty(3 * k, np.int64), np.empty(k, np.float32),
                                np.empty((2 * k, n), np.float32), np.empty(n, np.float32), x1, aux1, sk.xq, sk.aux)  # fmt: skip
    for counts in (np.zeros(n_exp), np.empty(0)):  # with the usage counts, without
        wr = _readonly(np.zeros((n_exp if fr >= 0 else 1, rb if fr >= 0 else 1), np.uint8))
        decode.moe_block(x, h, fr, fgu, fd, wr, tuple(ex), tuple(scratch), counts)


def _run_expert_tiles(qtypes=None) -> None:
    """grouped_matmul (the MoE prefill's f32 tiles) for every format: only models whose expert formats the integer
    kernel does not serve, or CPUs without it, call it (MoEFFN.needs_tiles)."""
    g = 2
    for qtype, fmt in _formats(qtypes):
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = N_IN // block * type_size
        w = _readonly(np.zeros(g * N_OUT * row_bytes, np.uint8))
        tiles = np.empty((numba.config.NUMBA_NUM_THREADS, TILE, N_IN), np.float32)
        starts = np.arange(g + 1, dtype=np.int64)
        x, gu = np.zeros((g, N_IN), np.float32), np.empty((2, g, N_IN), np.float32)
        grouped.grouped_matmul(fmt, w, np.zeros((2, g), np.int64), row_bytes, x, starts, gu, tiles)


def _run_int8() -> None:
    """The int8 prefill matmul of every format it serves, for each instruction set this CPU runs (the selected
    one already ran in its format group; the other serves STREAM_RUN_ISA=generic), and its grouped form."""
    for qtype in INT8:
        block, type_size = GGML_QUANT_SIZES[qtype]
        w = _readonly(np.zeros((N_OUT, N_IN // block * type_size), np.uint8))
        out = np.empty((2, N_OUT), np.float32)
        for isa in int8.usable_isas():
            if int8.serves(SUPPORTED[qtype].fmt, isa):
                int8.matmul(SUPPORTED[qtype].fmt, w, np.zeros((2, N_IN), np.float32), out, isa)
    _run_int8_grouped(None, int8.usable_isas())
    _run_lanes(None, lanes.isas())


def _run_int8_grouped(qtypes=None, isas=()) -> None:
    """The MoE prefill's grouped integer matmul (two parts, one expert of N_TOK rows) of the formats it serves
    (of qtypes, if given), on a read-only flat byte array (what both the file's mapping, for resident experts,
    and the expert cache's arena view, for streamed ones, are), with the activations quantized once and
    gathered per expert."""
    for qtype in INT8 if qtypes is None else INT8 & set(qtypes):
        block, type_size = GGML_QUANT_SIZES[qtype]
        w = _readonly(np.zeros((N_OUT, N_IN // block * type_size), np.uint8))
        fmt = SUPPORTED[qtype].fmt
        act = int8.gather(int8.quantize(fmt, np.zeros((2, N_IN), np.float32)), np.array([0, 1, -1, -1], np.int64))
        for isa in (i for i in isas if int8.serves(fmt, i)):
            flat = w.reshape(-1)  # read-only, as the file's mapping and the expert cache's arena view
            gu = np.empty((2, int8.N_TOK, N_OUT), np.float32)
            int8.grouped_matmul(
                fmt, flat, np.zeros((2, 1), np.int64), w.shape[1], act, np.array([0, int8.N_TOK]), gu, isa
            )


def _run_lanes(qtypes=None, isas=()) -> None:
    """The few-token experts' kernel (moe_compute.Fused._grouped_lanes) of the Q4_K experts (if of qtypes), on the
    activations quantized once (int8.quantize) and a read-only flat byte array, as _run_int8_grouped."""
    if not _lanes(T.Q4_K) or (qtypes is not None and T.Q4_K not in qtypes):
        return
    block, type_size = GGML_QUANT_SIZES[T.Q4_K]
    flat = _readonly(np.zeros(N_OUT * (N_IN // block * type_size), np.uint8))
    act = int8.quantize(SUPPORTED[T.Q4_K].fmt, np.zeros((2, N_IN), np.float32))
    rows, starts = np.arange(2, dtype=np.int64), np.array([0, 2], np.int64)
    out = np.empty((2, 2, N_OUT), np.float32)
    for isa in isas:
        lanes.grouped(flat, np.zeros((2, 1), np.int64), N_IN // block * type_size, act, rows, starts, out, isa)


def _lanes(qtype) -> bool:
    """lanes.grouped serves this format."""
    return qtype == T.Q4_K


def _lanes_kernels(isas) -> tuple:
    return (lanes.kernels(isas) + (lanes.pack,)) if isas else ()


def groups(qtypes=None, decode_combos=None, matrix_qtypes=None) -> list[Group]:
    """Everything a model run can call: one group per set of formats sharing kernels, then the ops, then the
    MoE kernels (qtypes: the matrix and MoE groups run those formats only; matrix_qtypes: the matrix groups run
    these instead; decode_combos: the decode blocks' format tuples by group name, else every block format
    uniformly)."""
    dc = decode_combos or {}
    lanes_isa = lanes.host_isa()
    return _matrix_groups(qtypes if matrix_qtypes is None else matrix_qtypes) + [
        Group(
            "ops",
            (ops.rmsnorm, ops.head_norm_rope, ops.head_rope, ops.attention, ops.swiglu, ops.swiglu_rows, ops.store_kv),
            _run_ops,
        ),
        Group(  # a hybrid model's linear attention and gated attention
            "recurrent",
            (recurrent.conv_silu, recurrent.delta_rule, recurrent.gated_rmsnorm, recurrent.sigmoid_gate),
            _run_recurrent,
        ),
        Group(
            "experts",
            (
                experts.experts_matvec,
                experts.experts_down,
                routing.topk_softmax,
                grouped.prepare_rows,
                grouped.grouped_gate_up,
                grouped.grouped_down,
                grouped.scatter_add,
            ),
            functools.partial(_run_experts, qtypes),
        ),
        Group("decode", (decode.attn_block,), functools.partial(_run_decode, dc.get("decode"))),
        Group("decode-ffn", (decode.ffn_block,), functools.partial(_run_decode_ffn, dc.get("decode-ffn"))),
        Group("decode-moe", (decode.moe_block,), functools.partial(_run_decode_moe, dc.get("decode-moe"))),
        Group("expert-tiles", (grouped.grouped_matmul,), functools.partial(_run_expert_tiles, qtypes)),
        Group(  # the MoE prefill's larger experts on this CPU's integer kernel (none without one)
            "expert-int8",
            (int8.GROUPED[int8.ISA], int8.quantize_act, int8.gather_act) if int8.ISA else (),
            functools.partial(_run_int8_grouped, qtypes, (int8.ISA,) if int8.ISA else ()),
        ),
        Group(  # the MoE prefill's few-token Q4_K experts (lanes.grouped), where an ISA runs them here
            "expert-lanes",
            ((int8.quantize_act,) + _lanes_kernels([lanes_isa])) if lanes_isa else (),
            functools.partial(_run_lanes, qtypes, (lanes_isa,) if lanes_isa else ()),
        ),
        Group(
            "int8",
            tuple(k[i] for k in (int8.KERNELS, int8.GROUPED) for i in int8.usable_isas())
            + (int8.gather_act,)
            + _lanes_kernels(lanes.isas()),
            _run_int8,
        ),
    ]


def decode_formats(model, moe=None) -> dict[str, list[tuple[int, ...]]]:
    """The format tuples `model` calls the decode blocks with, by group name (each tuple is compiled apart)."""
    out: dict[str, set] = {"decode": set(), "decode-ffn": set(), "decode-moe": set()}
    if model._decode is not None:
        attn, _, ffn = model._decode
        out["decode"].update(formats for formats, _ in attn)
        out["decode-ffn"].update(f[:3] for f in ffn or ())
    if moe is not None and moe.source.in_place:  # moe_block serves resident experts only (MoEFFN.decode)
        for layer, p in enumerate(moe.fused):
            if p is not None:
                blk = moe.router.mats[layer].block
                out["decode-moe"].add((blk[0] if blk is not None else -1, p.gate_up_format, p.down_format))
    return {k: sorted(v) for k, v in out.items()}


def _dispatchers(kernels) -> list:
    """The numba dispatchers behind kernels: a FormatKernel's own and its specialisations' (specialise.py)."""
    return [x for d in kernels for x in (d.dispatchers() if isinstance(d, FormatKernel) else [d])]


def _misses(kernels) -> int:
    return sum(sum(d.stats.cache_misses.values()) for d in _dispatchers(kernels))


def compiles() -> int:
    """Kernels numba has compiled in this process so far (every entry point and each specialisation made)."""
    return _misses(entry_points())


def common_groups(qtypes) -> list[str]:
    """The groups `stream-run warmup` runs for COMMON_RECIPES' formats (recipe_formats): all but every ISA's
    integer kernels (STREAM_RUN_ISA's other choice), and the f32 expert tiles only where some format of these
    mixes has no integer kernel here (MoEFFN.needs_tiles: with VNNI every one has; AVX2's serves Q4_0 and Q4_K)."""
    every = all(int8.serves(SUPPORTED[q].fmt) for q in qtypes & INT8)
    skip = {"int8"} | ({"expert-tiles"} if every and int8.ISA is not None else set())
    return [g.name for g in groups(qtypes) if g.name not in skip]


def entry_points() -> list:
    """The numba dispatchers a model calls directly (the others are inlined into these or called by them)."""
    return [d for g in groups() for d in g.kernels]


# `stream-run warmup` without a model: the demo's kernels (opened as the demo opens it) and those of these
# llama-quantize mixes (synth/recipes.py's per-tensor types) at a dense and a MoE geometry. Each format's
# kernels are compiled apart (kernels/specialise.py), so "every kernel" would be every format tuple: many
# minutes; other files' kernels compile at their first run, or with `stream-run warmup MODEL.gguf`.
COMMON_RECIPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
COMMON_PRESETS = ("qwen3-0.6b", "qwen3-30b-a3b")


def recipe_formats(recipes=COMMON_RECIPES, presets=COMMON_PRESETS) -> tuple[set, dict[str, list[tuple[int, ...]]]]:
    """(matrix types, decode blocks' format tuples by group name) of the files those mixes make at those
    geometries, computed from the recipes' rules without writing a file (as decode_formats reads a model)."""
    F = experts.FORMATS
    qtypes: set = set()
    combos: dict[str, set] = {"decode": set(), "decode-ffn": set(), "decode-moe": set()}
    for preset in presets:
        g = PRESETS[preset]
        for recipe in recipes:
            types = {n: t for n, _, t, _ in typed_tensors(SynthSpec(g, recipe=recipe), 151936)}
            qtypes |= {t for n, t in types.items() if "_norm" not in n and not n.endswith(".bias")}
            for i in range(g.n_layer):
                t = {
                    k.split(".", 2)[2].removesuffix(".weight"): v for k, v in types.items() if k.startswith(f"blk.{i}.")
                }
                attn = [t[k] for k in ("attn_q", "attn_k", "attn_v", "attn_output")]
                if all(q in F for q in attn):
                    combos["decode"].add(tuple(F[q] for q in attn))
                if g.n_expert:
                    r, gu, d = t["ffn_gate_inp"], t["ffn_gate_exps"], t["ffn_down_exps"]
                    if gu == t["ffn_up_exps"] and gu in F and d in F:
                        combos["decode-moe"].add((F[r] if r in F else -1, F[gu], F[d]))
                else:
                    ffn = [t[k] for k in ("ffn_gate", "ffn_up", "ffn_down")]
                    if all(q in F for q in ffn):
                        combos["decode-ffn"].add(tuple(F[q] for q in ffn))
    return qtypes, {k: sorted(v) for k, v in combos.items()}


def model_kernels(model, moe: bool = False, needs_tiles: bool = False) -> list:
    """The numba dispatchers a run of `model` may call directly: its formats' matrix kernels, the integer
    prefill kernel where it serves them, the ops, and for a MoE the expert kernels (grouped_matmul if
    needs_tiles)."""
    qtypes = {m.qtype for m in model.matrices()}
    int8_serves = {q for q in qtypes & INT8 if int8.serves(SUPPORTED[q].fmt)}  # their matmul is the integer kernel
    code = {q: SUPPORTED[q].fmt for q in qtypes | {model.embd.qtype}}  # each format's kernels (specialise.py)
    out = [SUPPORTED[q].matvec.specialise(code[q]) for q in qtypes]
    out += [SUPPORTED[q].matmul.specialise(code[q]) for q in qtypes - int8_serves]
    out.append(SUPPORTED[model.embd.qtype].rows.specialise(code[model.embd.qtype]))  # the embedding gather only
    i8 = int8.KERNELS.get(int8.ISA)
    out += [i8.specialise(code[q]) if isinstance(i8, FormatKernel) else i8 for q in int8_serves]
    combos = decode_formats(model, model.moe if moe else None)
    for name, k in (("decode", decode.attn_block), ("decode-ffn", decode.ffn_block), ("decode-moe", decode.moe_block)):
        out += [k.specialise(*c) for c in combos[name]]
    experts_q = {p.qtype for parts in model.moe.source.layout.parts for p in parts} if moe else set()
    if moe:
        names = ("ops", "experts", "decode", "decode-moe") + (("expert-tiles",) if needs_tiles else ())
        names += ("expert-int8",) if int8_serves else ()
        names += ("expert-lanes",) if lanes.host_isa() and any(_lanes(q) for q in experts_q) else ()
    else:
        names = ("ops",) + (("decode",) if model.decodes_in_blocks else ())
        names += ("decode-ffn",) if model.ffn_decodes_in_blocks else ()
    names += ("recurrent",) if model.cfg.full_attn_interval else ()
    for g in groups():
        if g.name in names:
            for d in g.kernels:  # the expert kernels for the experts' formats; the decode blocks' tuples are above
                if not isinstance(d, FormatKernel):
                    out.append(d)
                elif g.name in ("experts", "expert-tiles"):
                    out += [d.specialise(experts.FORMATS[q]) for q in sorted(experts_q) if q in experts.FORMATS]
                elif g.name == "expert-int8":
                    out += [
                        d.specialise(SUPPORTED[q].fmt)
                        for q in sorted(experts_q & INT8)
                        if int8.serves(SUPPORTED[q].fmt)
                    ]
    if not any(_lanes(q) for q in experts_q):  # lanes.grouped serves Q4_K experts only: never compiled otherwise
        lanes_k = set(_lanes_kernels(lanes.isas()))
        out = [d for d in out if d not in lanes_k]
    return list(dict.fromkeys(out))


def cached(dispatchers) -> bool:
    """Whether numba's on-disk cache holds machine code of each dispatcher for its current source. A run can then
    skip the warm-up and load each kernel at its first call. numba internals: anything unexpected answers False."""
    try:
        return all(
            d.in_cache() if isinstance(d, (Specialised, FormatKernel)) else d._cache._cache_file._load_index()
            for d in dispatchers
        )
    except Exception:
        return False


def loaded(dispatchers) -> list[str]:
    """Names of those dispatchers that have machine code in this process now (compiled or loaded)."""
    return sorted({d.py_func.__name__ for d in _dispatchers(dispatchers) if d.signatures})


def cache_dir() -> str:
    """Where numba keeps the compiled kernels (NUMBA_CACHE_DIR if set, else next to the kernel sources)."""
    return ops.rmsnorm.stats.cache_path


class Report(NamedTuple):
    name: str
    n_kernels: int  # compiled versions: a FormatKernel counts once per format tuple it ran (specialise.py)
    compiled: int  # kernels numba had to compile (the others came from its cache, or were already loaded)
    seconds: float


def warmup(
    before: Callable[[Group], None] | None = None,
    after: Callable[[Report], None] | None = None,
    only=None,
    qtypes=None,
    decode_combos=None,
) -> list[Report]:
    """Run every group (or those named in `only`; the MoE groups for the formats in `qtypes` only, if given);
    `before` is called with each group as it starts, `after` with its report."""
    reports = []
    for g in groups(qtypes, decode_combos):
        if only is not None and g.name not in only:
            continue
        if before is not None:
            before(g)
        misses = _misses(g.kernels)
        t0 = time.perf_counter()
        g.run()
        dt = time.perf_counter() - t0
        compiled = _misses(g.kernels) - misses
        units = sum(len(d.specs) if isinstance(d, FormatKernel) else 1 for d in g.kernels)
        r = Report(g.name, units, compiled, dt)
        reports.append(r)
        if after is not None:
            after(r)
    return reports


COMPILE_JOBS_ENV = "STREAM_RUN_COMPILE_JOBS"  # processes compiling a first run's kernels (default: up to 2)
HELPER_TIMEOUT_S = 900.0


def compile_jobs() -> int:
    """How many processes may compile a first run's kernels: STREAM_RUN_COMPILE_JOBS, else the CPUs this
    process may run on, at most 2 (numba compiles one kernel at a time per process, under a global lock)."""
    text = os.environ.get(COMPILE_JOBS_ENV, "")
    if text.strip().isdigit():
        return max(1, int(text))
    return max(1, min(2, len(os.sched_getaffinity(0))))


def _claim(claims: str, i: int) -> bool:
    """Take job i of a shared list (the first process to create its claim file runs it)."""
    try:
        os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def _run_claimed(jobs: list[Group], claims: str) -> None:
    for i, g in enumerate(jobs):
        if _claim(claims, i):
            g.run()


# Seconds to compile each kernel of the demo's first run (2026-12-06; integer kernels by their name before the ISA
# suffix). Only their order matters: the shared list puts the costliest groups first, so that the two processes
# finish together. Kernels not listed count 0.5 s.
COMPILE_S = {
    "attn_block": 12.8, "i8_matmul": 6.1, "i8_grouped": 5.1, "block_matvec": 5.1, "attention": 4.5,
    "experts_matvec": 3.7, "gather_act": 1.5, "experts_down": 2.9, "f32_matmul": 2.5, "grouped_down": 2.7,
    "grouped_gate_up": 1.2, "moe_block": 1.1,
}  # fmt: skip


def _cost(g: Group) -> float:
    names = [d.py_func.__name__ for d in g.kernels]
    return sum(next((v for k, v in COMPILE_S.items() if n.startswith(k)), 0.5) for n in names)


def _jobs(only, qtypes, decode_combos, matrix_qtypes) -> list[Group]:
    """The groups a first run compiles (those named in `only`, and the matrix groups of matrix_qtypes), the
    costliest first; the same list, in the same order, in this process and in its helper."""
    matrix = () if matrix_qtypes is None else {g.name for g in _matrix_groups(matrix_qtypes)}
    jobs = [g for g in groups(qtypes, decode_combos, matrix_qtypes) if g.name in only or g.name in matrix]
    return sorted(jobs, key=_cost, reverse=True)


def warmup_shared(
    first: Callable[[], None] | None,
    only,
    qtypes=None,
    decode_combos=None,
    helper_allowed: bool = True,
    matrix_qtypes=None,
) -> None:
    """Compile the groups named in `only` (and the matrix groups of matrix_qtypes, the formats `first` runs) and then
    `first` (this process's own work, e.g. Model.warmup), with a helper process taking groups from the same list
    (compile_jobs() > 1): numba's compiler holds one lock per process, and the helper's machine code reaches this
    process through the on-disk cache (kernels/_cachelock.py makes its saves whole). A helper that fails only costs
    the speed-up. helper_allowed: False where a second process's memory (about 300 MB) is not to be had."""
    jobs = _jobs(only, qtypes, decode_combos, matrix_qtypes)
    helper = None
    with tempfile.TemporaryDirectory(prefix="stream-run-compile-") as claims:
        if jobs and helper_allowed and compile_jobs() > 1:
            spec = {
                "claims": claims,
                "only": list(only),
                "qtypes": None if qtypes is None else sorted(int(q) for q in qtypes),
                "matrix_qtypes": None if matrix_qtypes is None else sorted(int(q) for q in matrix_qtypes),
                "decode_combos": None
                if decode_combos is None
                else {k: [[int(f) for f in c] for c in v] for k, v in decode_combos.items()},
            }
            # run from this package's parent directory: `-m` puts the working directory first on sys.path, so the
            # helper imports this very package, not another `streamer` the caller's directory may hold
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            try:
                helper = subprocess.Popen(
                    [sys.executable, "-m", "streamer.warmup", json.dumps(spec)],
                    cwd=root,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            except OSError:
                helper = None
        try:
            if helper is not None:
                _run_claimed(jobs, claims)
                helper.wait(HELPER_TIMEOUT_S)  # its last group: `first` would compile it again meanwhile
        except subprocess.TimeoutExpired:
            pass  # what it has not saved is compiled below
        finally:  # Ctrl-C, an error, or a helper past its time: it does not outlive this call
            if helper is not None and helper.poll() is None:
                helper.kill()
                helper.wait()
    if first is not None:
        first()
    for g in jobs:  # compiled here, loaded from the helper's cache entries, or compiled now if the helper failed
        g.run()


def _helper_main(argv: list[str]) -> None:
    """`python -m streamer.warmup SPEC`: the helper process of warmup_shared."""
    spec = json.loads(argv[0])
    qtypes, matrix = (
        {GGMLQuantizationType(q) for q in spec[k]} if spec[k] is not None else None for k in ("qtypes", "matrix_qtypes")
    )
    combos = spec["decode_combos"]
    combos = None if combos is None else {k: [tuple(c) for c in v] for k, v in combos.items()}
    _run_claimed(_jobs(spec["only"], qtypes, combos, matrix), spec["claims"])


__all__ = [
    "Group",
    "Report",
    "cache_dir",
    "cached",
    "common_groups",
    "compiles",
    "entry_points",
    "groups",
    "loaded",
    "model_kernels",
    "recipe_formats",
    "warmup",
    "warmup_shared",
]

if __name__ == "__main__":
    _helper_main(sys.argv[1:])
