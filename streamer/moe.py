"""Qwen3-MoE FFN: router softmax over all experts, top-k, renormalised weights (norm_topk_prob), optional
expert top-p, SwiGLU per selected expert, weighted sum. Experts come from an ExpertSource (resident or
streamed); each layer's experts are computed in ascending id order, so the floating-point sum per token is
the same whatever the cache did, and streamed logits are bit-identical to resident ones.

Prefill groups tokens by expert (each expert's weights are read once per chunk). Decode computes only the
routed experts, and the router lookahead predicts the next layer's experts for the prefetcher."""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np

from streamer.budget import Plan
from streamer.errors import StreamerError
from streamer.kernels import ops
from streamer.kernels.experts import FORMATS, ExpertScratch, experts_down, experts_matvec
from streamer.model import linear, qmatrix


def route(logits: np.ndarray, k: int, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """logits (m, n_expert) -> expert ids (m, k) and weights (m, k), by descending weight. With top_p < 1,
    per token keep the smallest prefix whose cumulative weight reaches top_p of the total, rescale the
    survivors to the same total, and mark the dropped ones with id -1 and weight 0."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    if top_p >= 1.0:
        return ids, w
    total = w.sum(axis=1, keepdims=True)
    cum = np.cumsum(w, axis=1)
    n_keep = (cum < top_p * total).sum(axis=1) + 1  # index of the first prefix reaching top_p, plus one
    keep = np.arange(k)[None, :] < n_keep[:, None]
    kept = np.where(keep, w, 0.0)
    w = kept * (total / kept.sum(axis=1, keepdims=True))
    return np.where(keep, ids, -1), w.astype(np.float32)


class MoEFFN:
    def __init__(self, gf, cfg, source, profiler, usage=None, expert_top_p: float = 1.0, prefetch: bool = True,
                 plan: Plan | None = None):
        """plan: the RAM budget plan the expert cache was sized by (None: sized exactly, or not streaming)."""
        self.gf, self.cfg, self.source, self.prof, self.usage = gf, cfg, source, profiler, usage
        self.expert_top_p, self.prefetch, self.plan = expert_top_p, prefetch, plan
        self.router = [qmatrix(gf, f"blk.{i}.ffn_gate_inp.weight") for i in range(cfg.n_layer)]
        self.ffn_norm = [gf.view(f"blk.{i}.ffn_norm.weight") for i in range(cfg.n_layer)]
        self.predicted: dict[int, np.ndarray] = {}
        self.window = cfg.n_expert_used  # experts requested ahead of the one being computed
        self.fused = [self._fused_plan(source.layout.parts[i]) for i in range(cfg.n_layer)]
        self.scratch_x = ExpertScratch(1, cfg.n_embd)
        self.scratch_a = ExpertScratch(cfg.n_expert_used, cfg.n_ff_exp)
        self._save = weakref.finalize(self, usage.save) if usage is not None else None  # once: close(), GC or exit

    @staticmethod
    def _fused_plan(parts):
        """(format code, row bytes) of gate/up and of down if the multi-expert kernels handle them, else None."""
        gate, up, down = parts
        if gate.qtype != up.qtype or gate.qtype not in FORMATS or down.qtype not in FORMATS:
            return None
        return FORMATS[gate.qtype], gate.nbytes // gate.n_rows, FORMATS[down.qtype], down.nbytes // down.n_rows

    # ---- router lookahead (a model hook) ----
    def after_attention(self, layer: int, x: np.ndarray) -> None:
        """Right after layer L's attention, apply layer L+1's ffn_norm and router to the residual: the
        experts it picks are prefetched while layer L computes. Decode only (one token)."""
        nxt = layer + 1
        if not self.prefetch or x.shape[0] != 1 or nxt >= self.cfg.n_layer or not self.source.wants_lookahead:
            return
        h = ops.rmsnorm(x, self.ffn_norm[nxt], self.cfg.rms_eps, np.empty_like(x))
        ids, _ = route(self.router[nxt].matvec(h[0]).reshape(1, -1), self.cfg.n_expert_used, self.expert_top_p)
        self.predicted[nxt] = ids[0][ids[0] >= 0]

    # ---- the FFN ----
    def __call__(self, layer: int, h: np.ndarray) -> np.ndarray:
        m, st = h.shape[0], self.prof.layers[layer]
        ids, w = route(linear(self.router[layer], h), self.cfg.n_expert_used, self.expert_top_p)
        used = ids >= 0
        st.routed += int(used.sum())
        st.dropped += int((~used).sum())
        if self.usage is not None:
            self.usage.record(layer, ids[used])
        pred = self.predicted.pop(layer, None)
        if pred is not None and m == 1:
            st.recall_hit += len(np.intersect1d(pred, ids[0][used[0]]))
            st.recall_total += int(used[0].sum())
        if layer == 0:
            self.prof.tokens += m
        out = np.zeros_like(h)
        experts = np.unique(ids[used])
        self.source.announce(layer, experts)
        nxt = self.predicted.get(layer + 1) if m == 1 else None
        if m == 1 and self.fused[layer] is not None:
            order = np.argsort(ids[0])  # expert weights in ascending id order, dropped (-1) first
            wts = w[0][order][ids[0][order] >= 0].astype(np.float32)
            self._run_fused(layer, experts, wts, h[0], out[0], nxt)
        else:
            self._run(layer, experts, h, ids, w, out, nxt)
        return out

    def _run_fused(self, layer, experts, wts, x, out, prefetch_next) -> None:
        """Decode: request every routed expert, then compute them with one gate+up and one down call (as many
        at a time as the cache holds at once; normally all). Every request is released, whatever happens."""
        src, group, i, stuck = self.source, [], 0, False
        try:
            while i < len(experts):
                while i < len(experts) and src.request(layer, int(experts[i])):
                    group.append(int(experts[i]))
                    i += 1
                if prefetch_next is not None:
                    src.prefetch(layer + 1, prefetch_next)  # after this layer's own misses are queued
                    prefetch_next = None
                if not group:
                    stuck = self._no_room(layer, stuck)
                    continue
                stuck = False
                for e in group:
                    src.wait(layer, e)
                self._fused(layer, group, wts[i - len(group):i], x, out)
                for e in group:
                    src.release(layer, e)
                group = []
        finally:
            for e in group:
                src.release(layer, e)

    def _fused(self, layer, group, wts, x, out) -> None:
        fmt_gu, rb_gu, fmt_d, rb_d = self.fused[layer]
        locs = [self.source.locate(layer, e) for e in group]
        base, g = locs[0][0], len(group)
        offs = np.array([o[0] for _, o in locs] + [o[1] for _, o in locs] + [o[2] for _, o in locs], np.int64)
        gu = np.empty((2 * g, self.cfg.n_ff_exp), np.float32)
        experts_matvec(fmt_gu, base, offs[:2 * g], rb_gu, x, gu, self.scratch_x.xq[0], self.scratch_x.aux[0])
        a = ops.swiglu(gu[:g], gu[g:], gu[:g])
        experts_down(fmt_d, base, offs[2 * g:], rb_d, a, wts, out, self.scratch_a.xq, self.scratch_a.aux)

    def _run(self, layer, experts, h, ids, w, out, prefetch_next) -> None:
        """Request experts ahead (up to the window), compute each in ascending id order as it arrives. Every
        request is released, even on Ctrl-C or an I/O error, so no slot stays referenced forever."""
        src, pending, i, done, stuck = self.source, deque(), 0, 0, False
        try:
            while done < len(experts):
                while i < len(experts) and len(pending) < self.window and src.request(layer, int(experts[i])):
                    pending.append(int(experts[i]))
                    i += 1
                if prefetch_next is not None and i == len(experts):
                    src.prefetch(layer + 1, prefetch_next)  # after this layer's own misses are queued
                    prefetch_next = None
                if not pending:
                    stuck = self._no_room(layer, stuck)
                    continue
                stuck = False
                done += 1
                e = pending[0]
                self._expert(src.wait(layer, e), e, h, ids, w, out)
                pending.popleft()
                src.release(layer, e)
        finally:
            for e in pending:
                src.release(layer, e)

    def _no_room(self, layer: int, stuck: bool) -> bool:
        """Nothing could be requested. First time: wait for in-flight prefetches to land (their slots become
        evictable) and let the caller retry. The cache reserves room for a layer's demand reads, so a second
        time means the cache really is full of pinned and in-use experts."""
        if stuck:
            raise StreamerError(f"the expert cache has no room for layer {layer}'s experts: every slot is pinned "
                                f"or in use (raise --ram-budget)")
        self.source.drain()
        return True

    @staticmethod
    def _expert(mats, e, h, ids, w, out) -> None:
        """out += weight * down(silu(gate x) * up x) for the tokens routed to expert e."""
        gate, up, down = mats
        if h.shape[0] == 1:  # decode: no gathering
            g = gate.matvec(h[0]).reshape(1, -1)
            y = down.matvec(ops.swiglu(g, up.matvec(h[0]).reshape(1, -1), g)[0])
            out[0] += np.float32(w[0, np.flatnonzero(ids[0] == e)[0]]) * y
        else:
            rows, slot = np.nonzero(ids == e)
            x = h[rows]
            g = linear(gate, x)
            y = linear(down, ops.swiglu(g, linear(up, x), g))
            out[rows] += w[rows, slot][:, None].astype(np.float32) * y

    def matrices(self) -> list:
        """Routers, and one expert of each layer straight from the mmap (for kernel warm-up only)."""
        return self.router + [qmatrix(self.gf, f"blk.{i}.ffn_{p}_exps.weight", 0)
                              for i in range(self.cfg.n_layer) for p in ("gate", "up", "down")]

    def close(self) -> None:
        self.source.close()
        if self._save is not None:
            self._save()
