"""One-token (decode) blocks of the forward pass, each one kernel call instead of five to ten: at decode the Python
between calls and each parallel launch's thread wake-up add up.

- attn_block: attn RMSNorm, q/k/v row dots in one prange over the rows of all three (x quantized once per
  format), biases, per-head norm + RoPE, the K/V store (float16, round to nearest even, as numpy's astype),
  attention, the output projection added into the residual, then ffn RMSNorm into h.
- ffn_block: dense SwiGLU: gate and up in one prange, SwiGLU, down added into the residual.
- moe_block: a MoE layer whose experts are all in place in one array (resident): router matvec (block_matvec),
  top-k (routing.topk_softmax), experts in ascending id order, gate+up (experts.experts_matvec), SwiGLU, down
  (experts.experts_down) into zeroed scratch, then added into the residual: the kernels and the order of
  additions of MoEFFN's streamed decode path, so resident logits stay bit-identical to streamed ones.

They compute what model.py's per-call path computes; blocks.prepare inlined here may round its scales in the last bit
otherwise (fast-math contexts), so the logits agree with that path to float32 rounding (tests/test_decode_blocks.py).
Streamed and resident runs both take these blocks: bit-identical to each other. Block formats only (model.py falls back
to the per-call path for float weights).

Arguments: the residual, the position and cache, the format codes (each tuple compiled apart, specialise.py), then
tuples of the layer's weights and scratch buffers, laid out by the NamedTuples below. Callers pass plain tuples:
numba's dispatcher types those on its fast path, NamedTuples on its slow one (2026-12-05: 1.9 against 3.7 us a call)."""

from typing import NamedTuple

import numpy as np
from numba import prange

from ._bits import FASTMATH, f32_to_f16_bits, kernel
from .blocks import block_matvec, dot, dot2, prepare
from .experts import experts_down, experts_matvec
from .ops import attention, head_norm_rope, head_rope, rmsnorm, swiglu
from .routing import topk_softmax
from .specialise import format_kernel


@kernel(fastmath=FASTMATH, inline="always")
def _prepare3(f0, f1, f2, x, xq, aux):
    """Quantize x for up to three formats into xq/aux rows 0..2; returns the row each format reads. One call per
    distinct format, not a loop over the three: in a kernel specialised to its formats (specialise.py) each call
    holds one format's code and the tests between the (constant) formats are pruned."""
    s1 = 0 if f1 == f0 else 1
    s2 = 0 if f2 == f0 else (1 if f2 == f1 else 2)
    prepare(f0, x, xq[0], aux[0])
    if f1 != f0:
        prepare(f1, x, xq[1], aux[1])
    if f2 != f0:
        if f2 != f1:
            prepare(f2, x, xq[2], aux[2])
    return (0, s1, s2)


@kernel(fastmath=FASTMATH, inline="always")
def _dot2_of(j, f0, f1, f2, w, off, stride, xq, dx, xs, n_in):
    """blocks.dot2 in format f0, f1 or f2 for j = 0, 1, 2: one inlined copy per distinct (constant) format."""
    if f1 != f0:
        if j == 1:
            return dot2(f1, w, off, stride, xq, dx, xs, n_in)
    if f2 != f0:
        if j == 2:
            return dot2(f2, w, off, stride, xq, dx, xs, n_in)
    return dot2(f0, w, off, stride, xq, dx, xs, n_in)


@kernel(fastmath=FASTMATH, inline="always")
def _dot_of(j, f0, f1, f2, w, off, xq, dx, xs, n_in):
    """blocks.dot in format f0, f1 or f2 for j = 0, 1, 2 (as _dot2_of)."""
    if f1 != f0:
        if j == 1:
            return dot(f1, w, off, xq, dx, xs, n_in)
    if f2 != f0:
        if j == 2:
            return dot(f2, w, off, xq, dx, xs, n_in)
    return dot(f0, w, off, xq, dx, xs, n_in)


@kernel(parallel=True, fastmath=FASTMATH, inline="always")
def _add_matvec(f, w, xq, dx, xs, n_in, y):
    """y[r] += row r of w . the prepared x, rows in pairs (blocks.dot2), the last alone if their number is odd."""
    n = y.size
    rb = w.shape[1]
    for p in prange((n + 1) >> 1):
        r = 2 * p
        if r + 1 < n:
            d0, d1 = dot2(f, w, r * rb, rb, xq, dx, xs, n_in)
            y[r] = y[r] + d0
            y[r + 1] = y[r + 1] + d1
        else:
            y[r] = y[r] + dot(f, w, r * rb, xq, dx, xs, n_in)


class AttnWeights(NamedTuple):
    """One layer's attention for attn_block: block-quantized matrices (their formats go apart), biases and q/k
    norms of size 0 when absent, the RoPE tables, the RMSNorm epsilon and the attention scale."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    eps: float
    wq: np.ndarray
    bq: np.ndarray
    wk: np.ndarray
    bk: np.ndarray
    wv: np.ndarray
    bv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    scale: np.float32
    wo: np.ndarray


class AttnScratch(NamedTuple):
    """attn_block's scratch: qkv_out (n_head hd + 2 n_kv hd) f32, q (1, n_head, hd) and k/v (1, n_kv, hd) views
    of it, att like q; xq/aux (3, n_embd)/(3, 3 n_embd/32 + 1) and xqo/auxo (n_head hd)/(3 n_head hd/32 + 1)
    activation buffers."""

    qkv_out: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    att: np.ndarray
    xq: np.ndarray
    aux: np.ndarray
    xqo: np.ndarray
    auxo: np.ndarray


@format_kernel("fq", "fk", "fv", "fo", parallel=True, fastmath=FASTMATH)
def attn_block(x, h, pos, kc, vc, fq, fk, fv, fo, W, S):
    """One token at position pos, in place on the residual x (1, n_embd); leaves ffn_norm(x) in h. kc/vc the
    layer's cache (n_kv, n_ctx, hd) uint16; W an AttnWeights, S an AttnScratch (as plain tuples)."""
    attn_norm, ffn_norm, eps, wq, bq, wk, bk, wv, bv, q_norm, k_norm, cos, sin, scale, wo = W
    qkv_out, q, k, v, att, xq, aux, xqo, auxo = S
    n = x.shape[1]
    ng = n >> 5
    rmsnorm(x, attn_norm, eps, h)
    slots = _prepare3(fq, fk, fv, h[0], xq, aux)
    nq, nk, nv = wq.shape[0], wk.shape[0], wv.shape[0]
    qkv = qkv_out.reshape(nq + nk + nv)  # q, k, v: views of it
    pq, pk, pv = (nq + 1) >> 1, (nk + 1) >> 1, (nv + 1) >> 1  # each matrix's rows in pairs (blocks.dot2)
    for tt in prange(pq + pk + pv):
        t = np.int64(tt)  # the prange index may be unsigned: t - pq would be float64
        if t < pq:
            j, w, r, at, m = 0, wq, 2 * t, 2 * t, nq
        elif t < pq + pk:
            j, w, r, at, m = 1, wk, 2 * (t - pq), nq + 2 * (t - pq), nk
        else:
            j, w, r, at, m = 2, wv, 2 * (t - pq - pk), nq + nk + 2 * (t - pq - pk), nv
        s = slots[j]
        rb = w.shape[1]
        if r + 1 < m:
            qkv[at], qkv[at + 1] = _dot2_of(j, fq, fk, fv, w, r * rb, rb, xq[s], aux[s, :ng], aux[s, ng : 3 * ng], n)
        else:
            qkv[at] = _dot_of(j, fq, fk, fv, w, r * rb, xq[s], aux[s, :ng], aux[s, ng : 3 * ng], n)
    qf, kf, vf = qkv[:nq], qkv[nq : nq + nk], qkv[nq + nk :]
    if bq.size:
        for r in range(nq):
            qf[r] += bq[r]
    if bk.size:
        for r in range(nk):
            kf[r] += bk[r]
    if bv.size:
        for r in range(nv):
            vf[r] += bv[r]
    if q_norm.size:
        head_norm_rope(q, q_norm, eps, cos, sin, pos)
    else:
        head_rope(q, cos, sin, pos)
    if k_norm.size:
        head_norm_rope(k, k_norm, eps, cos, sin, pos)
    else:
        head_rope(k, cos, sin, pos)
    n_kv, hd = k.shape[1], k.shape[2]
    for g in range(n_kv):
        for d in range(hd):
            kc[g, pos, d] = f32_to_f16_bits(k[0, g, d])
            vc[g, pos, d] = f32_to_f16_bits(v[0, g, d])
    attention(q, kc, vc, pos, scale, att)
    a = att.reshape(att.size)
    na = a.size
    dx, xs = prepare(fo, a, xqo, auxo)
    _add_matvec(fo, wo, xqo, dx, xs, na, x[0])
    rmsnorm(x, ffn_norm, eps, h)


class FFNScratch(NamedTuple):
    """ffn_block's scratch: gu (2, n_ff) f32, xq/aux (3, n_embd)/(3, 3 n_embd/32 + 1), xqa/auxa (n_ff)/(3 n_ff/32
    + 1)."""

    gu: np.ndarray
    xq: np.ndarray
    aux: np.ndarray
    xqa: np.ndarray
    auxa: np.ndarray


@format_kernel("fg", "fu", "fd", parallel=True, fastmath=FASTMATH)
def ffn_block(x, h, fg, fu, fd, wg, wu, wd, S):
    """Dense SwiGLU of one token added into the residual: x += down(silu(gate h) * up h); S an FFNScratch (as a
    plain tuple)."""
    gu, xq, aux, xqa, auxa = S
    n = h.shape[1]
    ng = n >> 5
    slots = _prepare3(fg, fu, fu, h[0], xq, aux)
    nf = wg.shape[0]
    npair = (nf + 1) >> 1  # each matrix's rows in pairs (blocks.dot2)
    for tt in prange(2 * npair):
        t = np.int64(tt)
        j = 0 if t < npair else 1
        w = wg if j == 0 else wu
        r = 2 * (t - j * npair)
        s = slots[j]
        rb = w.shape[1]
        if r + 1 < nf:
            gu[j, r], gu[j, r + 1] = _dot2_of(j, fg, fu, fu, w, r * rb, rb, xq[s], aux[s, :ng], aux[s, ng : 3 * ng], n)
        else:
            gu[j, r] = _dot_of(j, fg, fu, fu, w, r * rb, xq[s], aux[s, :ng], aux[s, ng : 3 * ng], n)
    g = gu[0:1]
    swiglu(g, gu[1:2], g)
    a = gu[0]
    dx, xs = prepare(fd, a, xqa, auxa)
    _add_matvec(fd, wd, xqa, dx, xs, nf, x[0])


class MoEExperts(NamedTuple):
    """A layer's experts in place for moe_block: at byte starts[p] + e sizes[p] of base for part p (gate, up,
    down), rows of rb_gu (gate, up) and rb_d (down) bytes."""

    base: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    rb_gu: int
    rb_d: int


class MoEScratch(NamedTuple):
    """moe_block's scratch: logits (1, n_expert), xqr/auxr the router's activation buffers; ids/wts (1, k) the
    top-k by weight (returned); offs (3k), sw (k) for them in ascending id order; gu (2k, n_ff), out (n_embd)
    f32; xq/aux (n_embd)/(3 n_embd/32 + 1), xqa/auxa (k, n_ff)/(k, 3 n_ff/32 + 1)."""

    logits: np.ndarray
    xqr: np.ndarray
    auxr: np.ndarray
    ids: np.ndarray
    wts: np.ndarray
    offs: np.ndarray
    sw: np.ndarray
    gu: np.ndarray
    out: np.ndarray
    xq: np.ndarray
    aux: np.ndarray
    xqa: np.ndarray
    auxa: np.ndarray


@format_kernel("fr", "fgu", "fd", parallel=True, fastmath=FASTMATH)
def moe_block(x, h, fr, fgu, fd, wr, E, S, counts):
    """One token's MoE FFN added into the residual x (1, n_embd), from h = ffn_norm(x). Router: if fr >= 0
    logits = wr h (format fr), else S's logits already hold them. E a MoEExperts, S a MoEScratch (as plain
    tuples); counts: the layer's usage counts (+1 per routed expert), or size 0."""
    base, starts, sizes, rb_gu, rb_d = E
    logits, xqr, auxr, ids, wts, offs, sw, gu, out, xq, aux, xqa, auxa = S
    if fr >= 0:
        block_matvec(fr, wr, h[0], logits[0], xqr, auxr)
    k = ids.shape[1]
    topk_softmax(logits, k, ids, wts)
    for i in range(k):  # insertion sort by expert id (ids are distinct), as np.argsort
        e, w = ids[0, i], wts[0, i]
        j = i
        while j > 0 and offs[j - 1] > e:
            offs[j] = offs[j - 1]
            sw[j] = sw[j - 1]
            j -= 1
        offs[j] = e
        sw[j] = w
    for i in range(k):
        e = offs[i]
        if counts.size:
            counts[e] += 1.0
        offs[2 * k + i] = starts[2] + e * sizes[2]
        offs[k + i] = starts[1] + e * sizes[1]
        offs[i] = starts[0] + e * sizes[0]
    experts_matvec(fgu, base, offs[: 2 * k], rb_gu, h[0], gu, xq, aux)
    a = gu[:k]
    swiglu(a, gu[k:], a)
    out[:] = 0.0
    experts_down(fd, base, offs[2 * k :], rb_d, a, sw, out, xqa, auxa)
    for r in range(out.size):
        x[0, r] = x[0, r] + out[r]
