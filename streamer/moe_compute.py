"""How a MoE layer computes its routed experts, chosen per layer when the FFN is built: the router (moe.py)
says which experts with which weights; one of these strategies turns them into the layer's output.

- Fused: the layer's formats run in the multi-expert kernels. Decode computes as many experts per kernel call
  as are ready; prefill groups the chunk's tokens by expert (each expert read once per chunk) and sends each
  expert to the row dots, the lanes or the matmul kernels by its token count.
- PerExpert: any other format, one expert at a time through QMatrix, reads up to `window` ahead.
- WholeLayer: one token with every expert resident (no lookahead, no expert top-p, no trace): the whole layer,
  router included, is one kernel call (decode.moe_block), the same additions as Fused's decode.

All of them compute a layer's experts in ascending id order and add each token's outputs in that order, so
the floating-point sum is the same whatever the cache did: streamed logits equal resident ones bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from streamer.experts.source import serve
from streamer.formats import Q4_K
from streamer.kernels import decode, int8, lanes, ops
from streamer.kernels.blocks import act_buffer
from streamer.kernels.experts import FORMATS, ExpertScratch, experts_down, experts_matvec
from streamer.kernels.gemm import TILE
from streamer.kernels.grouped import grouped_down, grouped_gate_up, grouped_matmul, prepare_rows, scatter_add
from streamer.weights import MATVEC_ROWS, linear

# A prefill expert with at most this many tokens goes through the grouped int16 row dots (one row read, a dot
# per token: the decode kernels' math), one with more through int8.grouped_matmul (integer tiles, reused across
# its tokens; grouped_matmul's f32 tiles without the integer kernel): model.linear's crossover between matvec and
# matmul. Where lanes.grouped serves the layer (LANES_MAX), the row dots still keep these experts: giving them to
# the lanes was faster per product but not on a 32-token prefill of the 30B-A3B file (2026-12-01).
GROUPED_MAX = MATVEC_ROWS
GROUPED_MAX_LANES = GROUPED_MAX


def _pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair ranges a[i]..b[i] of several experts -> (starts: expert i's pairs are starts[i]..starts[i+1] of
    idx, idx: the pair indices, concatenated)."""
    cnt = b - a
    cs = np.cumsum(cnt)
    return np.concatenate(([0], cs)), np.arange(cs[-1]) - np.repeat(cs - cnt, cnt) + np.repeat(a, cnt)


# A prefill expert with more than grouped_max and at most this many tokens goes through lanes.grouped (each Q4_K
# weight row read once and dotted with all of its tokens in vector lanes, no unpacked tiles; int8.DIGITS activation
# digits, as the integer tiles) where it runs (lanes.host_isa: VNNI or AVX2): at 128 tokens (about 8 per expert) the
# tiles' unpacking from RAM cost more than their products (bench/lanes_bench.py).
LANES_MAX = lanes.MAX_TOKENS


def _lanes_serve(plan) -> bool:
    """lanes.grouped serves this layer's experts here: Q4_K gate, up and down, an ISA for it."""
    return lanes.ready() and Q4_K == plan.gate_up_format == plan.down_format


def _by_token(toks: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(perm, tstarts): the pairs ordered by token, each token's in ascending expert order (a stable sort of
    pairs already in expert order), and token t's pairs at perm[tstarts[t]:tstarts[t + 1]], for m tokens."""
    perm = np.argsort(toks, kind="stable")
    return perm, np.searchsorted(toks[perm], np.arange(m + 1))


class ExpertRows(NamedTuple):
    """How the multi-expert decode kernels read one layer's experts: format code and bytes per row."""

    gate_up_format: int
    gate_up_row_bytes: int
    down_format: int
    down_row_bytes: int


def expert_rows(parts) -> ExpertRows | None:
    """The layer's ExpertRows if the multi-expert kernels handle its formats (gate and up alike), else None."""
    gate, up, down = parts
    if gate.qtype != up.qtype or gate.qtype not in FORMATS or down.qtype not in FORMATS:
        return None
    return ExpertRows(FORMATS[gate.qtype], gate.nbytes // gate.n_rows, FORMATS[down.qtype], down.nbytes // down.n_rows)


def needs_tiles(plans) -> bool:
    """Whether a prefill may call grouped_matmul: some layer's expert format is one the integer kernel does not
    serve here (warm-up compiles grouped_matmul only then)."""
    return any(p is not None and not (int8.serves(p.gate_up_format) and int8.serves(p.down_format)) for p in plans)


@dataclass
class Tuning:
    """The knobs the strategies share (tests and the trace read or set them on MoEFFN.tuning)."""

    window: int  # experts requested ahead of the one being computed
    group: int  # streamed prefill: experts computed together (reads run `window` ahead of them)
    grouped_max: int | None = None  # None: GROUPED_MAX, or GROUPED_MAX_LANES where the lanes serve
    lanes_max: int = LANES_MAX


class PerExpert:
    """Experts in formats the multi-expert kernels do not take: one at a time, by QMatrix."""

    def __init__(self, source, tuning: Tuning):
        self.source, self.tuning = source, tuning

    def decode(self, layer, h, ids, w, experts, wts, out, nxt) -> None:
        self.prefill(layer, h, ids, w, experts, out, nxt)

    def prefill(self, layer, h, ids, w, experts, out, nxt) -> None:

        def run(start, group, mats):
            self._expert(mats[0], group[0], h, ids, w, out)

        serve(self.source, layer, experts, run, self.tuning.window, nxt)

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


class Fused:
    """Experts whose formats the multi-expert kernels take (plans[layer] not None)."""

    def __init__(self, cfg, source, plans: list, tuning: Tuning):
        self.cfg, self.source, self.plans, self.tuning = cfg, source, plans, tuning
        self.scratch_x = ExpertScratch(1, cfg.n_embd)
        self.scratch_a = ExpertScratch(cfg.n_expert_used, cfg.n_ff_exp)
        self._tile_scratch: dict = {}

    def decode(self, layer, h, ids, w, experts, wts, out, nxt) -> None:
        """One token: as many experts per kernel call as are ready, in ascending id order (wts: their weights,
        in that order)."""

        def run(start, group, mats):
            self._decode_group(layer, group, wts[start : start + len(group)], h[0], out[0])

        serve(self.source, layer, experts, run, prefetch_next=nxt)

    def _decode_group(self, layer, group, wts, x, out) -> None:
        plan = self.plans[layer]
        base, offs = self.source.offsets(layer, group)
        g = len(group)
        gu = np.empty((2 * g, self.cfg.n_ff_exp), np.float32)
        sx, sa = self.scratch_x, self.scratch_a
        experts_matvec(plan.gate_up_format, base, offs[: 2 * g], plan.gate_up_row_bytes, x, gu, sx.xq[0], sx.aux[0])
        a = ops.swiglu(gu[:g], gu[g:], gu[:g])
        experts_down(plan.down_format, base, offs[2 * g :], plan.down_row_bytes, a, wts, out, sa.xq, sa.aux)

    def prefill(self, layer, h, ids, w, experts, out, nxt=None) -> None:
        """The chunk's tokens grouped by expert: each routed expert is read once, several experts per kernel
        call (kernels/grouped.py, int8.grouped_matmul): experts with at most grouped_max tokens by the decode
        row dots, the others by matmul (the integer kernel on h quantized once per layer, or dequantized f32
        tiles, as QMatrix.matmul). Reads run `window` experts ahead of the group being computed (streaming);
        resident experts are computed in one group; nxt (a batched decode step: the lookahead's union for the next
        layer) is prefetched once this layer's reads are queued. Each token's outputs of the row-dot experts are added into
        out in ascending expert order, those of the matmul experts into big_out likewise, and big_out into out
        at the end: the same additions whatever the grouping, so streamed == resident bit for bit (and a token
        with only row-dot experts gets exactly the per-token path's result)."""
        plan, m, k = self.plans[layer], h.shape[0], ids.shape[1]
        e_flat, t_flat = ids.reshape(-1), np.repeat(np.arange(m, dtype=np.int64), k)
        sel = np.flatnonzero(e_flat >= 0)
        order = sel[np.lexsort((t_flat[sel], e_flat[sel]))]  # pairs by (expert, token)
        pe, pt, pw = e_flat[order], t_flat[order], w.reshape(-1)[order].astype(np.float32)
        pstart = np.searchsorted(pe, experts, side="left")
        pend = np.searchsorted(pe, experts, side="right")
        cnt = pend - pstart
        # one lanes pass holds at most 16 tokens; lanes_max 0: none
        lanes_max = min(self.tuning.lanes_max, lanes.MAX_TOKENS) if _lanes_serve(plan) else 0
        small = cnt <= self._grouped_max(lanes_max)
        # 0: row dots (into out), 1: lanes (into lanes_out), 2: matmul (into big_out)
        kind = np.where(small, 0, np.where(cnt <= lanes_max, 1, 2))
        xq = aux = None  # h quantized for the row dots, only if some expert takes them
        if small.any():
            xq = act_buffer(h.shape[1], m)
            aux = np.empty((m, 3 * (h.shape[1] >> 5) + 1), np.float32)
            prepare_rows(plan.gate_up_format, h, xq, aux)
        lanes_out = np.zeros_like(out) if (kind == 1).any() else None
        big_out = np.zeros_like(out) if (kind == 2).any() else None
        # h quantized once per layer, for the lanes and the integer kernels alike; hq_mm None: the matmul experts
        # run on the f32 tiles
        hq = int8.quantize(plan.gate_up_format, h) if (kind == 1).any() else None
        hq_mm = None
        if (kind == 2).any() and int8.serves(plan.gate_up_format):
            hq_mm = hq if hq is not None else int8.quantize(plan.gate_up_format, h)

        def compute(start, group, mats):
            for k in range(3):
                pick = np.flatnonzero(kind[start : start + len(group)] == k)
                if len(pick) == 0:
                    continue
                sub = np.asarray(group)[pick]
                starts, idx = _pairs(pstart[start + pick], pend[start + pick])
                if k == 0:
                    self._grouped(layer, sub, starts, pt[idx], pw[idx], xq, aux, out)
                elif k == 1:
                    self._grouped_lanes(layer, sub, starts, pt[idx], pw[idx], hq, lanes_out)
                else:
                    self._grouped_mm(layer, sub, starts, pt[idx], pw[idx], h, hq_mm, big_out)

        t = self.tuning
        if self.source.in_place:
            serve(self.source, layer, experts, compute, len(experts), nxt, len(experts))
        else:
            serve(self.source, layer, experts, compute, t.group + t.window, nxt, t.group)
        if lanes_out is not None:
            out += lanes_out
        if big_out is not None:
            out += big_out

    def _grouped_max(self, lanes_max: int) -> int:
        """Experts with at most this many tokens take the row dots (the lanes take them where they serve)."""
        if self.tuning.grouped_max is not None:
            return self.tuning.grouped_max
        return GROUPED_MAX_LANES if lanes_max > 0 else GROUPED_MAX

    def _grouped(self, layer, group, starts, toks, weights, xq, aux, out) -> None:
        """Experts `group` (ascending) and their pairs (token toks[p], weight weights[p]; expert i's are
        starts[i]..starts[i+1]) by the int16 grouped kernels: out[t] += weight * down(silu(gate x_t) * up x_t),
        per token in ascending expert order."""
        plan, g, n_ff, P = self.plans[layer], len(group), self.cfg.n_ff_exp, len(toks)
        base, offs = self.source.offsets(layer, group)
        gu = np.empty((2, P, n_ff), np.float32)
        gu_offs = offs[: 2 * g].reshape(2, g)
        grouped_gate_up(plan.gate_up_format, base, gu_offs, plan.gate_up_row_bytes, xq, aux, starts, toks, gu)
        a = ops.swiglu_rows(gu[0], gu[1], gu[0])
        perm, tstarts = _by_token(toks, out.shape[0])
        aq = act_buffer(n_ff, P)
        aaux = np.empty((P, 3 * (n_ff >> 5) + 1), np.float32)
        down_offs = offs[2 * g :]
        grouped_down(
            plan.down_format, base, down_offs, starts, plan.down_row_bytes, a, aq, aaux, weights, tstarts, perm, out
        )

    def _grouped_mm(self, layer, group, starts, toks, weights, h, hq, out) -> None:
        """As _grouped, by matmul over each expert's tokens: for the whole group, one kernel call for gate and
        up, one for down (the integer kernel where it serves the format, as QMatrix.matmul decides, else
        dequantized f32 tiles), then scatter_add. Expert i's pairs get the activation rows rstarts[i].. of the
        group's matrices, padded to a multiple of int8.N_TOK (zero rows, for the integer kernel's token
        blocks); hq: h quantized for the gate/up format (int8.quantize, once per layer), None for f32 tiles."""
        plan, g, n_ff = self.plans[layer], len(group), self.cfg.n_ff_exp
        base, offs = self.source.offsets(layer, group)
        gu_offs, down_offs = offs[: 2 * g].reshape(2, g), offs[2 * g :].reshape(1, g)
        n = np.diff(starts)
        rstarts = np.concatenate(([0], np.cumsum(-(-n // int8.N_TOK) * int8.N_TOK)))
        rows = np.arange(len(toks)) + np.repeat(rstarts[:-1] - starts[:-1], n)  # pair p -> its activation row
        R = int(rstarts[-1])
        gu = np.empty((2, R, n_ff), np.float32)
        if hq is not None:
            tok = np.full(R, -1, np.int64)
            tok[rows] = toks
            int8.grouped_matmul(
                plan.gate_up_format, base, gu_offs, plan.gate_up_row_bytes, int8.gather(hq, tok), rstarts, gu
            )
        else:
            x = np.zeros((R, h.shape[1]), np.float32)
            x[rows] = h[toks]
            grouped_matmul(
                plan.gate_up_format, base, gu_offs, plan.gate_up_row_bytes, x, rstarts, gu, self._tiles(x.shape[1])
            )
        a = ops.swiglu_rows(gu[0], gu[1], gu[0])  # zero on the padding rows
        y = np.empty((1, R, h.shape[1]), np.float32)
        if int8.serves(plan.down_format):
            aq = int8.quantize(plan.down_format, a)
            int8.grouped_matmul(plan.down_format, base, down_offs, plan.down_row_bytes, aq, rstarts, y)
        else:
            grouped_matmul(plan.down_format, base, down_offs, plan.down_row_bytes, a, rstarts, y, self._tiles(n_ff))
        perm, tstarts = _by_token(toks, out.shape[0])
        wrow = np.zeros(R, np.float32)
        wrow[rows] = weights
        scatter_add(out, y[0], wrow, tstarts, rows[perm])

    def _grouped_lanes(self, layer, group, starts, toks, weights, hq, out) -> None:
        """As _grouped, by lanes.grouped (Q4_K, every expert of the group at most lanes.MAX_TOKENS tokens): one
        call for the group's gate and up rows on hq (h quantized once per layer), one for its down rows on the
        pairs' SwiGLU outputs (quantized), then scatter_add (per token in ascending expert order)."""
        plan, g, n_ff = self.plans[layer], len(group), self.cfg.n_ff_exp
        base, offs = self.source.offsets(layer, group)
        P, isa = len(toks), lanes.host_isa()
        gu = np.empty((2, P, n_ff), np.float32)
        lanes.grouped(base, offs[: 2 * g].reshape(2, g), plan.gate_up_row_bytes, hq, toks, starts, gu, isa)
        a = ops.swiglu_rows(gu[0], gu[1], gu[0])
        y = np.empty((1, P, out.shape[1]), np.float32)
        aq = int8.quantize(plan.down_format, a)
        lanes.grouped(base, offs[2 * g :].reshape(1, g), plan.down_row_bytes, aq, np.arange(P), starts, y, isa)
        perm, tstarts = _by_token(toks, out.shape[0])
        scatter_add(out, y[0], weights, tstarts, perm)

    def _tiles(self, n_in: int) -> np.ndarray:
        t = self._tile_scratch.get(n_in)
        if t is None:
            t = self._tile_scratch[n_in] = np.empty((numba.config.NUMBA_NUM_THREADS, TILE, n_in), np.float32)
        return t


class _DecodeScratch(NamedTuple):
    """WholeLayer's per-layer experts (decode.MoEExperts) and scratch (decode.MoEScratch), and the same as the
    plain tuples moe_block gets (numba types those on its fast path: kernels/decode.py)."""

    experts: list
    scratch: decode.MoEScratch
    plain: tuple
    no_router: np.ndarray
    no_counts: np.ndarray


class WholeLayer:
    """One token, every expert resident: router, experts and their sum in one kernel call (decode.moe_block:
    the same kernels and additions as Fused.decode, bit for bit)."""

    def __init__(self, cfg, source, plans: list, router_mats: list, fused: Fused):
        self.cfg, self.source, self.plans, self.router_mats, self.fused = cfg, source, plans, router_mats, fused
        self._dec: _DecodeScratch | None = None  # made on first use

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray, counts: np.ndarray | None) -> np.ndarray:
        """x += the layer's FFN of h; counts (the learned usage's row) gets the routed experts. Returns their
        ids (1, k)."""
        plan, d = self.plans[layer], self._dec
        if d is None:
            d = self._dec = self._scratch()
        mat = self.router_mats[layer]
        fr, wr = mat.block if mat.block is not None else (-1, d.no_router)
        if fr < 0:
            mat.matvec(h[0], d.scratch.logits[0])
        counts = d.no_counts if counts is None else counts
        decode.moe_block(x, h, fr, plan.gate_up_format, plan.down_format, wr, d.experts[layer], d.plain, counts)
        return d.scratch.ids

    def _scratch(self) -> _DecodeScratch:
        cfg, k = self.cfg, self.cfg.n_expert_used
        no_router = np.zeros((1, 1), np.uint8)
        no_router.flags.writeable = False  # the type of the file's views
        xr, sx, sa = ExpertScratch(1, cfg.n_embd), self.fused.scratch_x, self.fused.scratch_a
        scratch = decode.MoEScratch(
            logits=np.empty((1, cfg.n_expert), np.float32),
            xqr=xr.xq[0],
            auxr=xr.aux[0],
            ids=np.empty((1, k), np.int64),
            wts=np.empty((1, k), np.float32),
            offs=np.empty(3 * k, np.int64),
            sw=np.empty(k, np.float32),
            gu=np.empty((2 * k, cfg.n_ff_exp), np.float32),
            out=np.empty(cfg.n_embd, np.float32),
            xq=sx.xq[0],
            aux=sx.aux[0],
            xqa=sa.xq,
            auxa=sa.aux,
        )
        experts = []
        for i, p in enumerate(self.plans):
            starts, sizes = self.source.spans(i)
            rb = (p.gate_up_row_bytes, p.down_row_bytes) if p is not None else (0, 0)
            experts.append(tuple(decode.MoEExperts(self.source.gf.mm, starts, sizes, *rb)))
        return _DecodeScratch(experts, scratch, tuple(scratch), no_router, np.empty(0, np.float64))
