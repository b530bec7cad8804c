"""The model oracle: a plain float64 numpy forward of Qwen3 / Qwen3-MoE / Qwen2 (q/k/v biases, no q/k norm) /
Qwen3.5-MoE / Qwen3-Next (gated attention and Gated DeltaNet layers, a shared expert, after llama.cpp's qwen35moe
and qwen3next graphs)
over weights dequantized by gguf-py, read with gguf.GGUFReader (not our parser). No cache, no streaming, no
kernels. Slow and obvious on purpose."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two (positions, vocab) logit arrays."""
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


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
        self.n_rot = field("{a}.rope.dimension_count", self.hd)
        self.interval = field("{a}.full_attention_interval", 0)
        self.n_layer -= field("{a}.nextn_predict_layers", 0)
        self.ssm_k = field("{a}.ssm.group_count", 0)
        self.w = {}
        for t in r.tensors:
            data = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
            self.w[t.name] = data.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # x (n, heads, hd); NEOX on the first n_rot channels: i pairs with i + n_rot/2
        half = self.n_rot // 2
        ang = pos[:, None] * self.theta ** (-np.arange(half) * 2.0 / self.n_rot)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half : 2 * half]
        return np.concatenate([a * c - b * s, a * s + b * c, x[..., 2 * half :]], axis=-1)

    @staticmethod
    def silu(z):
        return z / (1.0 + np.exp(-z))

    def delta_net(self, i, h):
        """A Gated DeltaNet layer over the whole sequence from an empty state, one token at a time."""
        W, b, n = self.w, f"blk.{i}.", len(h)
        conv_w = W[b + "ssm_conv1d.weight"]  # (channels, K): column K-1 weighs the newest input
        K, nv = conv_w.shape[1], len(W[b + "ssm_a"])
        d = len(W[b + "ssm_norm.weight"])
        nk = self.ssm_k
        r = nv // nk
        if b + "ssm_in.weight" in W:  # older qwen3next files: per key head, its q, k, then its value heads' v and z
            qkvz = (h @ W[b + "ssm_in.weight"].T).reshape(n, nk, 2 * d + 2 * r * d)
            x = np.concatenate([qkvz[:, :, j * d : (j + 1) * d].reshape(n, -1) for j in range(2)]
                               + [qkvz[:, :, 2 * d : 2 * d + r * d].reshape(n, -1)], axis=1)  # fmt: skip
            z = qkvz[:, :, 2 * d + r * d :].reshape(n, nv, d)
        else:  # every head's q, then k, then v; z apart
            x = h @ W[b + "attn_qkv.weight"].T
            z = (h @ W[b + "attn_gate.weight"].T).reshape(n, nv, d)
        if b + "ssm_ba.weight" in W:  # qwen3next: per key head, its value heads' betas, then their alphas
            ba = (h @ W[b + "ssm_ba.weight"].T).reshape(n, nk, 2, r)
            b_in, a_in = ba[:, :, 0].reshape(n, nv), ba[:, :, 1].reshape(n, nv)
        else:
            b_in, a_in = h @ W[b + "ssm_beta.weight"].T, h @ W[b + "ssm_alpha.weight"].T
        if self.arch == "qwen3next":  # repeat-interleave: key head kh serves value heads kh*r .. kh*r + r-1
            key_head = [hh // r for hh in range(nv)]
        else:  # ggml_repeat tiles the key heads
            key_head = [hh % nk for hh in range(nv)]
        xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x])
        x = self.silu(np.stack([(xp[t : t + K] * conv_w.T).sum(axis=0) for t in range(n)]))
        q, k, v = x[:, : nk * d].reshape(n, nk, d), x[:, nk * d : 2 * nk * d].reshape(n, nk, d), x[:, 2 * nk * d :]
        q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), self.eps) / np.sqrt(d)
        k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), self.eps)
        v = v.reshape(n, nv, d)
        beta = 1.0 / (1.0 + np.exp(-b_in))
        g = W[b + "ssm_a"] * np.logaddexp(0.0, a_in + W[b + "ssm_dt.bias"])
        S, o = np.zeros((nv, d, d)), np.zeros((n, nv, d))
        for t in range(n):
            for hh in range(nv):
                kk, qq = k[t, key_head[hh]], q[t, key_head[hh]]
                S[hh] *= np.exp(g[t, hh])
                S[hh] += np.outer(beta[t, hh] * (v[t, hh] - S[hh] @ kk), kk)
                o[t, hh] = S[hh] @ qq
        o = self.rmsnorm(o, W[b + "ssm_norm.weight"]) * self.silu(z)
        return o.reshape(n, -1) @ W[b + "ssm_out.weight"].T

    def attention(self, i, h, pos):
        W, b, n = self.w, f"blk.{i}.", len(h)
        q = h @ W[b + "attn_q.weight"].T
        gate = None
        if q.shape[1] == 2 * self.n_head * self.hd:  # qwen35moe: per head, the query then an output gate
            q, gate = q.reshape(n, self.n_head, 2, self.hd)[:, :, 0], q.reshape(n, self.n_head, 2, self.hd)[:, :, 1]
        q = q.reshape(n, self.n_head, self.hd)
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
        if gate is not None:
            att = att / (1.0 + np.exp(-gate))
        return att.reshape(n, -1) @ W[b + "attn_output.weight"].T

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

    @staticmethod
    def skip_experts(i, routes, skip):
        """Cache-aware expert skipping, by its definition, on one layer's routes (as route returns them), in
        the forward calls skip["calls"] (token counts) of a run whose cache never evicts and reads nothing
        ahead, so an expert is present exactly when an earlier call read it (skip["seen"]: (layer, expert)).
        Per call: a token drops an expert that is not present, whose weight is below skip["threshold"] and
        which is not its top one, unless another token of the call keeps it; the rest are rescaled to sum 1.
        Counts skip["skipped"] (token, expert) pairs and skip["unread"] (layer call, expert) pairs."""
        out, start = [], 0
        for n in skip["calls"]:
            call = routes[start : start + n]
            start += n
            drop = [
                {
                    e
                    for j, (e, we) in enumerate(sel.items())
                    if j > 0 and (i, e) not in skip["seen"] and we < skip["threshold"]
                }
                for sel in call
            ]
            kept = {e for sel, d in zip(call, drop) for e in sel if e not in d}
            drop = [d - kept for d in drop]
            for sel, d in zip(call, drop):
                left = sum(we for e, we in sel.items() if e not in d)
                out.append({e: we / left for e, we in sel.items() if e not in d})
                skip["skipped"] += len(d)
            skip["unread"] += len(set().union(*drop))
            skip["seen"] |= {(i, e) for e in kept}
        return out

    def ffn(self, i, h, top_p, trace, skip=None):
        W = self.w

        def silu(z):
            return z / (1.0 + np.exp(-z))

        if f"blk.{i}.ffn_gate_inp.weight" not in W:
            g, u, d = (W[f"blk.{i}.ffn_{p}.weight"] for p in ("gate", "up", "down"))
            return (silu(h @ g.T) * (h @ u.T)) @ d.T
        out = np.zeros_like(h)
        D = W[f"blk.{i}.ffn_down_exps.weight"]
        if f"blk.{i}.ffn_gate_up_exps.weight" in W:  # merged: each expert's gate rows, then its up rows
            G, U = np.split(W[f"blk.{i}.ffn_gate_up_exps.weight"], 2, axis=1)
        else:
            G, U = W[f"blk.{i}.ffn_gate_exps.weight"], W[f"blk.{i}.ffn_up_exps.weight"]
        routes = self.route(h, W[f"blk.{i}.ffn_gate_inp.weight"], top_p)
        if skip is not None:
            routes = self.skip_experts(i, routes, skip)
        if trace is not None:
            trace[i] = routes
        for t, sel in enumerate(routes):
            for e, we in sel.items():
                out[t] += we * ((silu(G[e] @ h[t]) * (U[e] @ h[t])) @ D[e].T)
        if f"blk.{i}.ffn_gate_shexp.weight" in W:  # qwen35moe's shared expert, gated per token
            g, u, d = (W[f"blk.{i}.ffn_{p}_shexp.weight"] for p in ("gate", "up", "down"))
            gate = 1.0 / (1.0 + np.exp(-(h @ W[f"blk.{i}.ffn_gate_inp_shexp.weight"])))
            out += gate[:, None] * ((silu(h @ g.T) * (h @ u.T)) @ d.T)
        return out

    def logits(self, tokens, top_p: float = 1.0, trace: dict | None = None, skip: dict | None = None) -> np.ndarray:
        """All-position logits (n, vocab) for the token sequence starting at position 0. trace, if given,
        receives each MoE layer's routing: trace[layer] = [{expert: weight} per token]. skip: expert
        skipping's state (see skip_experts)."""
        W, n = self.w, len(tokens)
        pos = np.arange(n, dtype=np.float64)
        x = W["token_embd.weight"][np.asarray(tokens)]
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = self.rmsnorm(x, W[b + "attn_norm.weight"])
            recurrent = self.interval and (i + 1) % self.interval
            x = x + (self.delta_net(i, h) if recurrent else self.attention(i, h, pos))
            norm = W.get(b + "ffn_norm.weight", W.get(b + "post_attention_norm.weight"))
            x = x + self.ffn(i, self.rmsnorm(x, norm), top_p, trace, skip)
        head = W.get("output.weight", W["token_embd.weight"])
        return self.rmsnorm(x, W["output_norm.weight"]) @ head.T
