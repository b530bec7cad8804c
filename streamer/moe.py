"""Qwen3-MoE FFN: router softmax over all experts, top-k, renormalised weights (norm_topk_prob), optional
expert top-p and cache-aware expert skipping, SwiGLU per selected expert, weighted sum. Experts come from an
ExpertSource (resident or streamed); each layer's experts are computed in ascending id order, so the
floating-point sum per token is the same whatever the cache did, and streamed logits are bit-identical to
resident ones.

Routing is here (Router: which experts, with which weights, and the lookahead's guess for the next layer);
computing the routed experts is moe_compute.py's (one strategy per layer, chosen when the FFN is built);
scheduling the reads is experts.source.serve's (the one request/prefetch/release loop); accounting is the
per-layer traffic counters (ExpertTraffic) and the learned usage."""

from __future__ import annotations

import weakref

import numpy as np

from streamer.budget import BudgetSplit
from streamer.experts.cache import grows
from streamer.experts.source import part_matrix
from streamer.kernels import ops
from streamer.kernels.routing import topk_softmax
from streamer.moe_compute import Fused, PerExpert, Tuning, WholeLayer, expert_rows, needs_tiles
from streamer.weights import linear, qmatrix


def route(logits: np.ndarray, k: int, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """logits (m, n_expert) -> expert ids (m, k) and weights (m, k), by descending weight. With top_p < 1,
    per token keep the smallest prefix whose cumulative weight reaches top_p of the total, rescale the
    survivors to the same total, and mark the dropped ones with id -1 and weight 0."""
    return apply_top_p(*route_topk(logits, k), top_p)


def route_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, the top k by descending weight (ties: lower id first), renormalised (before
    expert top-p). One kernel call (kernels/routing.py)."""
    logits = np.ascontiguousarray(logits, np.float32)
    ids = np.empty((logits.shape[0], k), np.int64)
    w = np.empty((logits.shape[0], k), np.float32)
    topk_softmax(logits, k, ids, w)
    return ids, w


def apply_top_p(ids: np.ndarray, w: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Expert top-p over route_topk's output (see route); top_p >= 1 returns its arguments unchanged."""
    if top_p >= 1.0:
        return ids, w
    k = ids.shape[1]
    total = w.sum(axis=1, keepdims=True)
    cum = np.cumsum(w, axis=1)
    n_keep = (cum < top_p * total).sum(axis=1) + 1  # index of the first prefix reaching top_p, plus one
    keep = np.arange(k)[None, :] < n_keep[:, None]
    kept = np.where(keep, w, 0.0)
    w = kept * (total / kept.sum(axis=1, keepdims=True))
    return np.where(keep, ids, -1), w.astype(np.float32)


def apply_skip(ids: np.ndarray, w: np.ndarray, threshold: float, present: np.ndarray):
    """Cache-aware expert skipping over route's output: an expert is dropped for a token when it is not
    present (neither cached nor in flight: present is a bool array like ids), its share of the token's routing
    weight is below threshold, it is not the token's top expert, and no other token of the call keeps it (that
    token reads it anyway). A token's survivors are rescaled to its old total, as expert top-p does; tokens
    that lose nothing keep their weights bit for bit. -> (ids with the skipped ones -1, weights, skipped mask)."""
    total = w.sum(axis=1, keepdims=True)
    skip = ~present & (ids >= 0) & (w < threshold * total)
    skip[:, 0] = False  # route orders by weight: the top expert is always computed
    if skip.any() and ids.shape[0] > 1:
        skip &= ~np.isin(ids, ids[(ids >= 0) & ~skip])
    if not skip.any():
        return ids, w, skip
    rows = skip.any(axis=1)
    kept = np.where(skip[rows], 0.0, w[rows])
    w = w.copy()
    w[rows] = kept * (total[rows] / kept.sum(axis=1, keepdims=True))
    return np.where(skip, -1, ids), w, skip


class Router:
    """Each layer's router (and its ffn_norm, for the lookahead): routed expert ids and weights."""

    def __init__(self, gf, cfg, expert_top_p: float = 1.0):
        self.cfg, self.expert_top_p = cfg, expert_top_p
        self.mats = [qmatrix(gf, f"blk.{i}.ffn_gate_inp.weight") for i in range(cfg.n_layer)]
        self.ffn_norm = [gf.view(f"blk.{i}.{cfg.ffn_norm}.weight") for i in range(cfg.n_layer)]
        self.trace = None  # a streamer.trace.TraceRecorder: gets the top-k before and after expert top-p
        self._h = np.empty((1, cfg.n_embd), np.float32)  # the lookahead's scratch
        self._logits = np.empty((1, cfg.n_expert), np.float32)

    def __call__(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids_k, w_k = route_topk(linear(self.mats[layer], h), self.cfg.n_expert_used)
        ids, w = apply_top_p(ids_k, w_k, self.expert_top_p)
        if self.trace is not None:
            self.trace.route(layer, ids_k, w_k, w)
        return ids, w

    def predict(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts `layer` would pick for the residual x (m, n_embd) of a decode step's tokens (before
        their attention): ids and weights (m, k) after expert top-p, as __call__ returns them."""
        m = x.shape[0]
        h = ops.rmsnorm(x, self.ffn_norm[layer], self.cfg.rms_eps, self._h if m == 1 else np.empty_like(x))
        logits = self._logits if m == 1 else np.empty((m, self.cfg.n_expert), np.float32)
        for b in range(m):
            self.mats[layer].matvec(h[b], logits[b])
        ids_k, w_k = route_topk(logits, self.cfg.n_expert_used)
        if self.trace is not None:
            self.trace.lookahead(layer, ids_k, w_k)
        return apply_top_p(ids_k, w_k, self.expert_top_p)


class MoEFFN:
    """A MoE layer's FFN: the router, then the layer's compute strategy (moe_compute.py: Fused, PerExpert, or
    WholeLayer for a resident token). Around them: the lookahead (after_attention guesses the next layer's
    experts for prefetch), the cache's growth policy and prefault start, and the routing's accounting."""

    def __init__(
        self,
        gf,
        cfg,
        source,
        traffic,
        usage=None,
        expert_top_p: float = 1.0,
        prefetch: bool = True,
        plan: BudgetSplit | None = None,
        expert_skip: float = 0.0,
    ):
        """plan: the RAM budget plan the expert cache was sized by (None: sized exactly, or not streaming).
        expert_skip: apply_skip's threshold (0: off); its decisions ask the source which experts are present."""
        self.gf, self.cfg, self.source, self.traffic, self.usage = gf, cfg, source, traffic, usage
        self.prefetch, self.plan, self.expert_skip = prefetch, plan, expert_skip
        self.router = Router(gf, cfg, expert_top_p)
        self.predicted: dict[int, np.ndarray] = {}
        self.tuning = Tuning(window=cfg.n_expert_used, group=cfg.n_expert_used)
        self.fused = [expert_rows(source.layout.parts[i]) for i in range(cfg.n_layer)]
        fused = Fused(cfg, source, self.fused, self.tuning)
        per_expert = PerExpert(source, self.tuning)
        self.compute = [per_expert if p is None else fused for p in self.fused]
        self.whole_layer = WholeLayer(cfg, source, self.fused, self.router.mats, fused)
        self.step = -1  # forwards so far, less one (a layer-0 call starts one), as the trace counts steps
        # a cache with a slot for every expert never evicts: there a prompt's experts are worth the fresh slots
        self.roomy = getattr(source, "cache", None) is not None and source.cache.n_slots >= cfg.n_layer * cfg.n_expert
        # the cache's prefault thread, started once the first layer call has loaded its kernels (experts/prefault.py)
        self._prefault = getattr(getattr(source, "cache", None), "prefaulter", None)
        self._save = weakref.finalize(self, usage.save) if usage is not None else None  # once: close(), GC or exit

    @property
    def expert_top_p(self) -> float:
        return self.router.expert_top_p

    def after_attention(self, layer: int, x: np.ndarray) -> None:
        """A model hook, called in decode steps (one token, or one per sequence of a batch): right after layer
        L's attention, apply layer L+1's ffn_norm and router to the residual; the experts it picks (for a batch,
        the union of every token's) are prefetched while layer L computes."""
        nxt = layer + 1
        if self.prefetch and nxt < self.cfg.n_layer and self.source.wants_lookahead:
            ids, w = self.router.predict(nxt, x)
            if self.expert_skip > 0:  # what the layer would skip now is not worth reading ahead
                ids, w, _ = apply_skip(ids, w, self.expert_skip, self.source.present(nxt, ids))
            self.predicted[nxt] = ids[0][ids[0] >= 0] if len(ids) == 1 else np.unique(ids[ids >= 0])

    def __call__(self, layer: int, h: np.ndarray, step: bool = False) -> np.ndarray:
        """The layer's FFN of h (m, n_embd): route, record, compute the routed experts in ascending id order.
        step: the m tokens are a decode step of m sequences, not a prompt (the cache grows as for decode, the
        lookahead's union of next-layer experts is prefetched behind this layer's, and the uses the batch
        shares are counted)."""
        m = h.shape[0]
        self._starting(layer, 1 if step else m)
        ids, w = self.router(layer, h)
        if not self.roomy:  # a cache with a slot for every expert never evicts: nothing to hold back
            self.source.limit_growth()
        n_skipped = 0
        if self.expert_skip > 0:
            ids, w, n_skipped = self._skip(layer, ids, w)
        self.traffic.routed(layer, ids, self.predicted.pop(layer, None), n_skipped)
        used = ids[ids >= 0]
        if step and m > 1:
            self._count_shared(layer, used, np.unique(used))
        if self.usage is not None:
            self.usage.record(layer, used)
        if m == 1:  # one token's ids are distinct: sorting them gives the experts and, alongside, their weights
            order = np.argsort(ids[0])  # ascending, dropped (-1) first
            keep = ids[0][order] >= 0
            experts, wts = ids[0][order][keep], w[0][order][keep]
        else:
            experts = np.unique(used)
        self.source.announce(layer, experts)
        out = np.zeros_like(h)
        if m == 1:
            self.compute[layer].decode(layer, h, ids, w, experts, wts, out, self.predicted.get(layer + 1))
        else:
            self.compute[layer].prefill(layer, h, ids, w, experts, out, self.predicted.get(layer + 1) if step else None)
        return out

    def _skip(self, layer: int, ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """apply_skip against the experts the source has (cached or in flight), counted in the traffic: the
        routing weight share skipped, and the bytes of the experts no token of the call reads."""
        new_ids, new_w, skip = apply_skip(ids, w, self.expert_skip, self.source.present(layer, ids))
        n = int(skip.sum())
        if n:
            share = float(((w * skip).sum(axis=1) / w.sum(axis=1)).sum())
            nbytes = len(np.unique(ids[skip])) * self.source.layout.expert_bytes(layer)
            self.traffic.skipped(layer, n, share, nbytes)
        return new_ids, new_w, n

    def decode(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """A decode step, one token per sequence: x += this layer's FFN of h (= ffn_norm(x)). One token runs as
        one kernel call (WholeLayer) where every expert is resident and nothing needs the routing between its
        steps (lookahead, expert top-p, trace)."""
        src, r = self.source, self.router
        routing_seen = src.wants_lookahead or r.expert_top_p < 1.0 or r.trace is not None
        if self.fused[layer] is None or not src.in_place or routing_seen:
            x += self(layer, h, step=True)
            return
        # every expert in place: each token as its own one-call step (bit for bit its result alone; with tokens
        # that rarely share an expert the grouped kernels saved nothing and cost more Python per layer)
        counts = self.usage.counts[layer] if self.usage is not None else None
        m = h.shape[0]
        ids = np.concatenate([self.whole_layer(layer, h[b : b + 1], x[b : b + 1], counts).copy() for b in range(m)])
        self.traffic.routed(layer, ids, self.predicted.pop(layer, None))
        used = ids[ids >= 0]
        experts = np.unique(used) if m > 1 else used
        if m > 1:
            self._count_shared(layer, used, experts)
        src.request_all(layer, experts)

    def _count_shared(self, layer: int, used: np.ndarray, experts: np.ndarray) -> None:
        """A batched step's sharing: its uses beyond its distinct experts were served by an expert another
        sequence of the step reads too; each would have asked for the expert's bytes alone."""
        n = len(used) - len(experts)
        self.traffic.shared(layer, n, n * self.source.layout.expert_bytes(layer))

    def _starting(self, layer: int, m: int) -> None:
        """Per layer call: count the steps, start the prefault thread after the first layer (its kernels are
        loaded by then), and let a prompt reuse cache slots before taking fresh ones."""
        self.step += layer == 0
        if self._prefault is not None and (layer > 0 or self.step > 0):
            self._prefault.start()
            self._prefault = None
        self.source.grow = grows(self.roomy, m, self.step)

    def needs_tiles(self) -> bool:
        return needs_tiles(self.fused)

    def matrices(self) -> list:
        """Routers, and one expert of each layer straight from the mmap (for kernel warm-up only)."""
        return self.router.mats + [part_matrix(self.gf, p, 0) for ps in self.source.layout.parts for p in ps]

    def close(self) -> None:
        self.source.close()
        if self._save is not None:
            self._save()
