"""The model oracle: a plain float64 numpy forward of Qwen3 / Qwen3-MoE / Qwen2 (q/k/v biases, no q/k norm)
over weights dequantized by gguf-py, read with gguf.GGUFReader (not our parser). No cache, no streaming, no
kernels. Slow and obvious on purpose."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Reference:
    def __init__(self, path: str):
        r = GGUFReader(path)
        self.arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
        a = self.arch

        def field(key, default=None):
            f = r.fields.get(key.format(a=a))
            return default if f is None else f.parts[f.data[0]][0].item()

        self.n_layer = field("{a}.block_count")
        self.n_head = field("{a}.attention.head_count")
        self.n_kv = field("{a}.attention.head_count_kv")
        self.hd = field("{a}.attention.key_length") or field("{a}.embedding_length") // self.n_head
        self.eps = field("{a}.attention.layer_norm_rms_epsilon")
        self.theta = field("{a}.rope.freq_base")
        self.n_used = field("{a}.expert_used_count", 0)
        self.w = {}
        for t in r.tensors:
            data = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
            self.w[t.name] = data.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # x (n, heads, hd); NEOX: channel i pairs with i + hd/2
        half = self.hd // 2
        ang = pos[:, None] * self.theta ** (-np.arange(half) * 2.0 / self.hd)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def route(self, h, router, top_p=1.0):
        """Per token: softmax over all experts, top-k, renormalise, then expert top-p. -> list of {expert: weight}."""
        out = []
        for row in h @ router.T:
            p = np.exp(row - row.max())
            p /= p.sum()
            top = np.argsort(-p, kind="stable")[: self.n_used]
            w = p[top] / p[top].sum()
            keep, cum = [], 0.0
            for e, we in zip(top, w):  # already sorted by weight, descending
                keep.append((e, we))
                cum += we
                if cum >= top_p * 1.0:
                    break
            kept = sum(we for _, we in keep)
            out.append({int(e): we / kept for e, we in keep})
        return out

    def ffn(self, i, h, top_p, trace):
        W = self.w

        def silu(z):
            return z / (1.0 + np.exp(-z))

        if f"blk.{i}.ffn_gate_inp.weight" not in W:
            g, u, d = (W[f"blk.{i}.ffn_{p}.weight"] for p in ("gate", "up", "down"))
            return (silu(h @ g.T) * (h @ u.T)) @ d.T
        out = np.zeros_like(h)
        G, U, D = (W[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        routes = self.route(h, W[f"blk.{i}.ffn_gate_inp.weight"], top_p)
        if trace is not None:
            trace[i] = routes
        for t, sel in enumerate(routes):
            for e, we in sel.items():
                out[t] += we * ((silu(G[e] @ h[t]) * (U[e] @ h[t])) @ D[e].T)
        return out

    def logits(self, tokens, top_p: float = 1.0, trace: dict | None = None) -> np.ndarray:
        """All-position logits (n, vocab) for the token sequence starting at position 0. trace, if given,
        receives each MoE layer's routing: trace[layer] = [{expert: weight} per token]."""
        W, n = self.w, len(tokens)
        pos = np.arange(n, dtype=np.float64)
        x = W["token_embd.weight"][np.asarray(tokens)]
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = self.rmsnorm(x, W[b + "attn_norm.weight"])
            q = (h @ W[b + "attn_q.weight"].T).reshape(n, self.n_head, self.hd)
            k = (h @ W[b + "attn_k.weight"].T).reshape(n, self.n_kv, self.hd)
            v = (h @ W[b + "attn_v.weight"].T).reshape(n, self.n_kv, self.hd)
            if b + "attn_q.bias" in W:  # qwen2: q/k/v biases, no per-head norm
                q = q + W[b + "attn_q.bias"].reshape(self.n_head, self.hd)
                k = k + W[b + "attn_k.bias"].reshape(self.n_kv, self.hd)
                v = v + W[b + "attn_v.bias"].reshape(self.n_kv, self.hd)
                q, k = self.rope(q, pos), self.rope(k, pos)
            else:
                q = self.rope(self.rmsnorm(q, W[b + "attn_q_norm.weight"]), pos)
                k = self.rope(self.rmsnorm(k, W[b + "attn_k_norm.weight"]), pos)
            att = np.zeros((n, self.n_head, self.hd))
            mask = np.triu(np.full((n, n), -np.inf), 1)
            for hh in range(self.n_head):
                g = hh // (self.n_head // self.n_kv)
                s = q[:, hh] @ k[:, g].T / np.sqrt(self.hd) + mask
                p = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh] = (p / p.sum(axis=1, keepdims=True)) @ v[:, g]
            x = x + att.reshape(n, -1) @ W[b + "attn_output.weight"].T
            x = x + self.ffn(i, self.rmsnorm(x, W[b + "ffn_norm.weight"]), top_p, trace)
        head = W.get("output.weight", W["token_embd.weight"])
        return self.rmsnorm(x, W["output_norm.weight"]) @ head.T
