"""A layer's token mixers: what mixes information across positions, each owning its per-sequence state.

- Attention: grouped-query attention with RoPE over K/V rows (qwen2, qwen3, qwen3moe);
- GatedAttention: the hybrids' full-attention layers (an output gate per head, RoPE on part of the head);
- GatedDeltaNet: the hybrids' linear-attention layers, a fixed-size recurrent state (kernels/recurrent.py).

A mixer is called with the normed residual h (m, n_embd) of positions pos0.. and its state for this sequence,
and returns what is added to the residual.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from streamer.config import ModelConfig
from streamer.gguf_file import GGUFFile
from streamer.kernels import QMatrix, decode, ops, recurrent
from streamer.state import KVRows, Recurrent
from streamer.weights import linear, qmatrix


class Mixer(Protocol):
    def new_state(self, n_ctx: int): ...

    def matrices(self) -> list[QMatrix]: ...

    def __call__(self, h: np.ndarray, state, pos0: int) -> np.ndarray: ...

    def step(self, h: np.ndarray, states: list, positions: list[int]) -> np.ndarray: ...


def one_by_one(mix: Mixer, h: np.ndarray, states: list, positions: list[int]) -> np.ndarray:
    """A decode step of several sequences as separate one-token calls: row b of h is sequence b's token at
    positions[b], mixed with its own state."""
    return np.concatenate([mix(h[b : b + 1], st, pos) for b, (st, pos) in enumerate(zip(states, positions))])


class Attention:
    """Grouped-query attention with RoPE, the token mixer of qwen2/qwen3 layers: Qwen3 has per-head q/k RMSNorm,
    Qwen2 q/k/v biases instead (None if absent). Its per-sequence state is one layer's K/V rows."""

    def __init__(self, gf: GGUFFile, i: int, cfg: ModelConfig, cos, sin):
        b = f"blk.{i}."

        def opt(name):
            return gf.view(b + name) if b + name in gf.tensors else None

        self.cfg, self.cos, self.sin = cfg, cos, sin
        self.scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        self.q_norm, self.k_norm = opt("attn_q_norm.weight"), opt("attn_k_norm.weight")
        self.bq, self.bk, self.bv = opt("attn_q.bias"), opt("attn_k.bias"), opt("attn_v.bias")
        self.wq, self.wk, self.wv, self.wo = (qmatrix(gf, b + f"attn_{p}.weight") for p in ("q", "k", "v", "output"))

    def new_state(self, n_ctx: int) -> KVRows:
        return KVRows(self.cfg.n_head_kv, n_ctx, self.cfg.head_dim)

    def matrices(self) -> list[QMatrix]:
        return [self.wq, self.wk, self.wv, self.wo]

    def __call__(self, h: np.ndarray, kv: KVRows, pos0: int) -> np.ndarray:
        cfg, m = self.cfg, h.shape[0]
        q, k, v = linear(self.wq, h), linear(self.wk, h), linear(self.wv, h)
        for out, bias in ((q, self.bq), (k, self.bk), (v, self.bv)):
            if bias is not None:
                out += bias
        att = self._attend(q.reshape(m, cfg.n_head, cfg.head_dim), k, v, kv, pos0)
        return linear(self.wo, att.reshape(m, -1))

    def step(self, h: np.ndarray, states: list[KVRows], positions: list[int]) -> np.ndarray:
        """A decode step of several sequences, row b of h being sequence b's token at positions[b]: the
        projections of all rows together (each weight row read once for the batch), the attention of each row
        over its own sequence's K/V."""
        cfg, m = self.cfg, h.shape[0]
        q, k, v = linear(self.wq, h), linear(self.wk, h), linear(self.wv, h)
        for out, bias in ((q, self.bq), (k, self.bk), (v, self.bv)):
            if bias is not None:
                out += bias
        q = q.reshape(m, 1, cfg.n_head, cfg.head_dim)
        att = np.empty((m, cfg.n_head, cfg.head_dim), np.float32)
        for b, (kv, pos) in enumerate(zip(states, positions)):
            att[b] = self._attend(q[b], k[b : b + 1], v[b : b + 1], kv, pos)[0]
        return linear(self.wo, att.reshape(m, -1))

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv: KVRows, pos0: int) -> np.ndarray:
        """Norm and rotate q (m, n_head, head_dim) and k, store k and v, attend: (m, n_head, head_dim)."""
        cfg, m = self.cfg, q.shape[0]
        k = k.reshape(m, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(m, cfg.n_head_kv, cfg.head_dim)
        self.norm_rope(q, self.q_norm, pos0)
        self.norm_rope(k, self.k_norm, pos0)
        ops.store_kv(k, v, kv.k, kv.v, pos0)  # (m, n_kv, head_dim) at positions pos0 ..
        return ops.attention(q, kv.k, kv.v, pos0, self.scale, np.empty_like(q))

    def norm_rope(self, x: np.ndarray, w, pos0: int) -> None:
        if w is None:
            ops.head_rope(x, self.cos, self.sin, pos0)
        else:
            ops.head_norm_rope(x, w, self.cfg.rms_eps, self.cos, self.sin, pos0)

    def block_args(self, attn_norm, ffn_norm) -> tuple[tuple, tuple] | None:
        """decode.attn_block's formats (fq, fk, fv, fo) and weights for this layer, with the norms around it
        (None if a matrix is not block-quantized)."""
        mats = [m.block for m in self.matrices()]
        if None in mats:
            return None
        none = np.empty(0, np.float32)
        none.flags.writeable = False  # the same array type as the file's views
        bq, bk, bv, qn, kn = (none if a is None else a for a in (self.bq, self.bk, self.bv, self.q_norm, self.k_norm))
        (fq, wq), (fk, wk), (fv, wv), (fo, wo) = mats
        eps, cos, sin = self.cfg.rms_eps, self.cos, self.sin
        w = decode.AttnWeights(attn_norm, ffn_norm, eps, wq, bq, wk, bk, wv, bv, qn, kn, cos, sin, self.scale, wo)
        return (fq, fk, fv, fo), tuple(w)  # a plain tuple: numba types it on its fast path (kernels/decode.py)


class GatedAttention(Attention):
    """The hybrids' full attention (qwen35moe, qwen3next): attn_q yields, per head, the query then an output
    gate; the attention's output is multiplied by sigmoid(gate) before attn_output. q/k RMSNorm per head; RoPE
    (NEOX) on the first rope.dimension_count channels (the tables' width). No one-call decode block: the
    per-call path."""

    def __call__(self, h: np.ndarray, kv: KVRows, pos0: int) -> np.ndarray:
        cfg, m = self.cfg, h.shape[0]
        qg = linear(self.wq, h).reshape(m, cfg.n_head, 2, cfg.head_dim)
        q = np.ascontiguousarray(qg[:, :, 0])
        att = self._attend(q, linear(self.wk, h), linear(self.wv, h), kv, pos0).reshape(m, -1)
        recurrent.sigmoid_gate(att, np.ascontiguousarray(qg[:, :, 1]).reshape(m, -1))
        return linear(self.wo, att)

    def step(self, h: np.ndarray, states: list[KVRows], positions: list[int]) -> np.ndarray:
        return one_by_one(self, h, states, positions)

    def block_args(self, attn_norm, ffn_norm) -> None:
        return None


class GatedDeltaNet:
    """Linear attention (qwen35moe, qwen3next): q, k, v projected -> causal conv1d + SiLU -> q, k (ssm.group_count
    heads), v (ssm.time_step_rank heads) -> the gated delta rule per value head -> RMSNorm(ssm_norm) * SiLU(z)
    -> ssm_out. Value head h reads key head h // (n_v / n_k) in qwen3next, h % n_k in qwen35moe.
    The projections come in three layouts, told apart by the file's tensors: attn_qkv (q, k, v) and attn_gate (z)
    with ssm_beta and ssm_alpha (qwen35moe); the same two with ssm_ba (per key head: the betas, then the alphas of
    its value heads; qwen3next from newer converters); ssm_in (per key head: its q, k, then the v and z of its
    value heads) with ssm_ba (older qwen3next files). Its state: the conv's last K-1 inputs and one (d, d) matrix
    per value head."""

    def __init__(self, gf: GGUFFile, i: int, cfg: ModelConfig):
        b = f"blk.{i}."
        self.cfg = cfg
        self.grouped = cfg.arch == "qwen3next"  # the key head of value head h: h // (n_v / n_k)
        self.fused_in = b + "ssm_in.weight" in gf.tensors
        self.fused_ba = b + "ssm_ba.weight" in gf.tensors
        names = ("ssm_in",) if self.fused_in else ("attn_qkv", "attn_gate")
        names += ("ssm_ba",) if self.fused_ba else ("ssm_beta", "ssm_alpha")
        self.w_in = [qmatrix(gf, f"{b}{n}.weight") for n in names]
        self.wout = qmatrix(gf, b + "ssm_out.weight")
        self.conv = gf.view(b + "ssm_conv1d.weight")
        self.dt, self.a, self.norm = gf.view(b + "ssm_dt.bias"), gf.view(b + "ssm_a"), gf.view(b + "ssm_norm.weight")

    def new_state(self, n_ctx: int) -> Recurrent:
        return Recurrent(**self.cfg.recurrent_shapes)

    def matrices(self) -> list[QMatrix]:
        return self.w_in + [self.wout]

    def _project(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(qkv (m, conv channels), z (m, n_v d), beta (m, n_v), alpha (m, n_v)), contiguous."""
        c, m = self.cfg, h.shape[0]
        nk, d, r = c.ssm_k_heads, c.ssm_head_dim, c.ssm_v_heads // c.ssm_k_heads
        if self.fused_in:
            qkvz = linear(self.w_in[0], h).reshape(m, nk, 2 * d + 2 * r * d)
            parts = (qkvz[:, :, :d], qkvz[:, :, d : 2 * d], qkvz[:, :, 2 * d : 2 * d + r * d])
            qkv = np.concatenate([p.reshape(m, -1) for p in parts], axis=1)
            z = np.ascontiguousarray(qkvz[:, :, 2 * d + r * d :]).reshape(m, -1)
        else:
            qkv, z = linear(self.w_in[0], h), linear(self.w_in[1], h)
        if not self.fused_ba:
            return qkv, z, linear(self.w_in[-2], h), linear(self.w_in[-1], h)
        ba = linear(self.w_in[-1], h).reshape(m, nk, 2, r)
        beta, alpha = (np.ascontiguousarray(ba[:, :, j]).reshape(m, -1) for j in range(2))
        return qkv, z, beta, alpha

    def __call__(self, h: np.ndarray, st: Recurrent, pos0: int) -> np.ndarray:
        c, m = self.cfg, h.shape[0]
        qkv, z, beta, alpha = self._project(h)
        mixed = np.empty_like(qkv)
        recurrent.conv_silu(qkv, self.conv, st.cur["conv"], st.new["conv"], mixed)
        o = np.empty((m, c.ssm_v_heads * c.ssm_head_dim), np.float32)
        group = c.ssm_v_heads // c.ssm_k_heads if self.grouped else 0
        args = (c.ssm_k_heads, group, np.float32(c.rms_eps), st.cur["ssm"], st.new["ssm"], o)
        recurrent.delta_rule(mixed, beta, alpha, self.dt, self.a, *args)
        recurrent.gated_rmsnorm(o, z, self.norm, c.rms_eps, o)
        return linear(self.wout, o)

    def step(self, h: np.ndarray, states: list[Recurrent], positions: list[int]) -> np.ndarray:
        return one_by_one(self, h, states, positions)


def mixer(gf: GGUFFile, i: int, cfg: ModelConfig, cos, sin) -> Mixer:
    """Layer i's token mixer, by architecture and layer type."""
    if cfg.is_recurrent(i):
        return GatedDeltaNet(gf, i, cfg)
    if cfg.full_attn_interval:
        return GatedAttention(gf, i, cfg, cos, sin)
    return Attention(gf, i, cfg, cos, sin)
