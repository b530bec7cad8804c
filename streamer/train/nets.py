"""Qwen3 and Qwen3-MoE in torch, for training only: the same math stream-run runs (tests/reference.py is the
oracle): pre-norm blocks, GQA attention with per-head q/k RMSNorm and NEOX RoPE, SwiGLU FFN; MoE layers route
with a softmax over all experts, keep the top k and renormalise them (norm_topk_prob). The MoE forward sorts
the token-expert pairs by expert and runs one matmul per expert over its rows (no per-token Python)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class NetConfig:
    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int = 0  # dense FFN width (dense model)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    n_ctx: int = 512

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def to_dict(self) -> dict:
        return asdict(self)


def rope_tables(cfg: NetConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / cfg.head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd); NEOX layout: channel i pairs with i + hd/2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: NetConfig):
        super().__init__()
        self.c = c
        self.q = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def forward(self, h, cos, sin):
        c, (B, T, _) = self.c, h.shape
        q = self.q(h).view(B, T, c.n_head, c.head_dim)
        k = self.k(h).view(B, T, c.n_head_kv, c.head_dim)
        v = self.v(h).view(B, T, c.n_head_kv, c.head_dim).transpose(1, 2)
        q = rope(F.rms_norm(q, (c.head_dim,), self.q_norm, c.rms_eps).transpose(1, 2), cos, sin)
        k = rope(F.rms_norm(k, (c.head_dim,), self.k_norm, c.rms_eps).transpose(1, 2), cos, sin)
        rep = c.n_head // c.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # query head h -> kv head h // rep
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class DenseFFN(nn.Module):
    def __init__(self, c: NetConfig):
        super().__init__()
        self.gate = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.up = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, c.n_embd, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h)), None


class MoE(nn.Module):
    def __init__(self, c: NetConfig):
        super().__init__()
        self.c = c
        X, E, Fe = c.n_expert, c.n_embd, c.n_ff_exp
        self.router = nn.Linear(E, X, bias=False)
        self.gate = nn.Parameter(torch.randn(X, Fe, E) * E**-0.5)  # GGUF ffn_gate_exps order (expert, ff, embd)
        self.up = nn.Parameter(torch.randn(X, Fe, E) * E**-0.5)
        self.down = nn.Parameter(torch.randn(X, E, Fe) * Fe**-0.5)

    def forward(self, h):
        c, shape = self.c, h.shape
        x = h.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        topw, topi = probs.topk(c.n_expert_used, dim=-1)
        topw = topw / topw.sum(-1, keepdim=True)
        flat = topi.reshape(-1)
        order = flat.argsort(stable=True)
        tok = order // c.n_expert_used
        counts = torch.bincount(flat, minlength=c.n_expert)
        xs = x.index_select(0, tok)
        # split/unbind once: slicing per expert would make backward write a full-size zero gradient per expert
        sizes = counts.tolist()
        gates, ups, downs = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        outs = [
            (F.silu(xe @ gates[e].T) * (xe @ ups[e].T)) @ downs[e].T for e, xe in enumerate(xs.split(sizes)) if sizes[e]
        ]
        ys = torch.cat(outs) * topw.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, tok, ys)
        # Switch / Qwen load-balancing loss: X * sum_e (share of routed slots to e) * (mean router prob of e)
        frac = counts.float() / flat.numel()
        aux = c.n_expert * (frac * probs.mean(0)).sum()
        return out.view(shape), (aux, counts)


class Block(nn.Module):
    def __init__(self, c: NetConfig):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(c.n_embd))
        self.ffn_norm = nn.Parameter(torch.ones(c.n_embd))
        self.attn = Attention(c)
        self.ffn = MoE(c) if c.is_moe else DenseFFN(c)
        self.eps = c.rms_eps

    def forward(self, x, cos, sin):
        x = x + self.attn(F.rms_norm(x, x.shape[-1:], self.attn_norm, self.eps), cos, sin)
        y, extra = self.ffn(F.rms_norm(x, x.shape[-1:], self.ffn_norm, self.eps))
        return x + y, extra


class Net(nn.Module):
    def __init__(self, c: NetConfig):
        super().__init__()
        self.c = c
        self.embd = nn.Embedding(c.n_vocab, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.out_norm = nn.Parameter(torch.ones(c.n_embd))
        self.head = nn.Linear(c.n_embd, c.n_vocab, bias=False)
        self._init()

    def _init(self):
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            if name.endswith(("gate", "up", "down")) and p.dim() == 3:
                continue  # expert stacks: initialised in MoE
            nn.init.normal_(p, std=0.02)
        scale = (2 * self.c.n_layer) ** -0.5  # residual-branch outputs start small (GPT-2 style)
        for b in self.blocks:
            with torch.no_grad():
                b.attn.o.weight.mul_(scale)
                if self.c.is_moe:
                    b.ffn.down.mul_(scale)
                else:
                    b.ffn.down.weight.mul_(scale)

    def forward(self, ids):
        T = ids.shape[1]
        cos, sin = rope_tables(self.c, T)
        x = self.embd(ids)
        extras = []
        for b in self.blocks:
            x, e = b(x, cos, sin)
            extras.append(e)
        return self.head(F.rms_norm(x, x.shape[-1:], self.out_norm, self.c.rms_eps)), extras
