"""Qwen3 / Qwen2 forward pass: embed -> L x (attention + FFN) -> norm -> head, over zero-copy views of the GGUF.

The FFN of each layer is a pluggable object (dense SwiGLU here, MoE in streamer.moe) called as
`ffn(layer, h) -> (m, n_embd)`; hooks get `after_attention(layer, x)` so an expert prefetcher can look
ahead. Prefill (many tokens, matrix-matrix kernels) and decode (one token, matrix-vector) share the layer code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from streamer import interrupts
from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.filewatch import FileWatch
from streamer.gguf_file import GGUFFile
from streamer.kernels import QMatrix, decode, ops
from streamer.kernels.experts import ExpertScratch
from streamer.mixers import Mixer, mixer
from streamer.state import SequenceState
from streamer.weights import linear, linear_few, qmatrix


class FFN(Protocol):
    def __call__(self, layer: int, h: np.ndarray) -> np.ndarray: ...

    def matrices(self) -> list[QMatrix]:
        """Every weight matrix it computes with (kernel warm-up compiles one kernel per format)."""


class DenseFFN:
    """SwiGLU: down(silu(gate h) * up h), weights used in place from the mmap."""

    def __init__(self, gf: GGUFFile, n_layer: int, suffix: str = ""):
        names = [f"ffn_{p}{suffix}.weight" for p in ("gate", "up", "down")]
        self.w = [tuple(qmatrix(gf, f"blk.{i}.{n}") for n in names) for i in range(n_layer)]

    def matrices(self) -> list[QMatrix]:
        return [m for ws in self.w for m in ws]

    def block_args(self, layer: int) -> tuple | None:
        """decode.ffn_block's (fg, fu, fd, wg, wu, wd) for this layer (None if a matrix is not block-quantized)."""
        parts = [m.block for m in self.w[layer]]
        return None if None in parts else tuple(p[0] for p in parts) + tuple(p[1] for p in parts)

    def __call__(self, layer: int, h: np.ndarray) -> np.ndarray:
        gate, up, down = self.w[layer]
        g = linear(gate, h)
        act = ops.swiglu_rows if h.shape[0] > 1 else ops.swiglu  # exp is scalar here: ~1 ms at 128 x 3072
        return linear(down, act(g, linear(up, h), g))


class WithSharedExpert:
    """A MoE FFN plus a shared expert that every token uses, weighted by sigmoid(ffn_gate_inp_shexp . h)
    (qwen35moe, qwen3next). The shared expert's weights are used in place."""

    def __init__(self, routed: FFN, gf: GGUFFile, n_layer: int):
        self.routed = routed
        self.shared = DenseFFN(gf, n_layer, "_shexp")
        self.gate = [gf.view(f"blk.{i}.ffn_gate_inp_shexp.weight") for i in range(n_layer)]
        if hasattr(routed, "after_attention"):
            self.after_attention = routed.after_attention

    def matrices(self) -> list[QMatrix]:
        return self.routed.matrices() + self.shared.matrices()

    def _shared(self, layer: int, h: np.ndarray) -> np.ndarray:
        y = self.shared(layer, h)
        y *= (1.0 / (1.0 + np.exp(-(h @ self.gate[layer])))).astype(np.float32)[:, None]
        return y

    def __call__(self, layer: int, h: np.ndarray) -> np.ndarray:
        y = self._shared(layer, h)
        y += self.routed(layer, h)
        return y

    def decode(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """One token: x += the shared expert's output, then the routed experts' (MoEFFN.decode: one kernel call
        when every expert is in place)."""
        x += self._shared(layer, h)
        self.routed.decode(layer, h, x)


class Layer:
    """One block: x += mixer(attn_norm(x)); x += ffn(ffn_norm(x)). The FFN is the model's, called with the
    layer's index (its experts are one store across layers)."""

    def __init__(self, gf: GGUFFile, i: int, mixer: Mixer, ffn_norm: str = "ffn_norm"):
        self.attn_norm = gf.view(f"blk.{i}.attn_norm.weight")
        self.ffn_norm = gf.view(f"blk.{i}.{ffn_norm}.weight")
        self.mixer = mixer


class Model:
    def __init__(
        self,
        gf: GGUFFile,
        cfg: ModelConfig,
        ffn: FFN | None = None,
        n_ctx: int | None = None,
        watch: FileWatch | None = None,
    ):
        """watch: checked before each forward (the file must not change under the mapping)."""
        self.gf, self.cfg, self.watch = gf, cfg, watch
        self.n_ctx = cfg.context(n_ctx)
        cos, sin = ops.rope_tables(self.n_ctx, cfg.n_rot or cfg.head_dim, cfg.rope_theta)
        self.layers = [Layer(gf, i, mixer(gf, i, cfg, cos, sin), cfg.ffn_norm) for i in range(cfg.n_layer)]
        self.moe = ffn  # the routed experts' FFN, if any
        self.ffn = ffn if ffn is not None else DenseFFN(gf, cfg.n_layer)
        if cfg.n_ff_shexp:
            self.ffn = WithSharedExpert(self.ffn, gf, cfg.n_layer)
        self.embd = qmatrix(gf, "token_embd.weight")
        self.head = self.embd if cfg.tied else qmatrix(gf, "output.weight")
        self.out_norm = gf.view("output_norm.weight")
        self.hooks: list = [self.ffn] if hasattr(self.ffn, "after_attention") else []  # after_attention(layer, x)
        self.ubatch = 512  # prefill chunk: bounds scratch memory, like llama.cpp's n_ubatch
        self._decode = self._decode_args()

    @property
    def decodes_in_blocks(self) -> bool:
        """Whether one-token steps run kernels/decode.py's one-call blocks (block-quantized weights)."""
        return self._decode is not None

    @property
    def ffn_decodes_in_blocks(self) -> bool:
        """Whether one-token steps run the dense FFN as decode.ffn_block (dense, block-quantized FFN)."""
        return self._decode is not None and self._decode[2] is not None

    def _decode_args(self):
        """Per layer, the arguments of kernels/decode.py's one-call blocks for one-token steps: attention
        (attn_block) and, for the dense FFN, ffn_block. None for the per-call path (float weights, or the
        hybrids' mixers, which have no block)."""
        cfg = self.cfg
        attn = [getattr(L.mixer, "block_args", lambda *_: None)(L.attn_norm, L.ffn_norm) for L in self.layers]
        if None in attn:
            return None
        nq, nkv, hd, n = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_embd
        qkv, att = np.empty((nq + 2 * nkv) * hd, np.float32), np.empty((1, nq, hd), np.float32)
        q = qkv[: nq * hd].reshape(1, nq, hd)
        k, v = qkv[nq * hd : (nq + nkv) * hd].reshape(1, nkv, hd), qkv[(nq + nkv) * hd :].reshape(1, nkv, hd)
        x3, xo = ExpertScratch(3, n), ExpertScratch(1, nq * hd)  # blocks.prepare's buffers, as the experts'
        scratch = tuple(decode.AttnScratch(qkv, q, k, v, att, x3.xq, x3.aux, xo.xq[0], xo.aux[0]))
        ffn = None
        if isinstance(self.ffn, DenseFFN):
            ffn = [self.ffn.block_args(i) for i in range(cfg.n_layer)]
            if None in ffn:
                ffn = None
            else:
                n_ff = self.ffn.w[0][0].n_out
                xa = ExpertScratch(1, n_ff)
                fs = tuple(decode.FFNScratch(np.empty((2, n_ff), np.float32), x3.xq, x3.aux, xa.xq[0], xa.aux[0]))
                ffn = [a + (fs,) for a in ffn]
        return attn, scratch, ffn

    def new_state(self) -> SequenceState:
        return SequenceState([L.mixer.new_state(self.n_ctx) for L in self.layers], self.n_ctx)

    def matrices(self) -> list[QMatrix]:
        mats = [self.embd, self.head]
        for L in self.layers:
            mats += L.mixer.matrices()
        return mats + self.ffn.matrices()

    def warmup(self) -> None:
        """Run every kernel once on tiny inputs so numba compiles (or loads from its cache) before timing starts."""
        seen = set()
        for m in self.matrices():
            if m.qtype not in seen:
                seen.add(m.qtype)
                one = m.first_rows(1)
                one.matvec(np.zeros(m.n_in, np.float32))
                one.matmul(np.zeros((2, m.n_in), np.float32))
        self.embd.rows(np.zeros(1, np.int64))
        linear_few(self.head.first_rows(16), np.zeros((2, self.head.n_in), np.float32))  # a batched step's head
        cfg, L = self.cfg, self.layers[0]
        kinds = {type(L.mixer): L.mixer for L in self.layers}.values()  # one of each kind of mixer
        for m in (2, 1):
            x = np.zeros((m, cfg.n_embd), np.float32)
            ops.rmsnorm(x, L.attn_norm, cfg.rms_eps, x)
            for mix in kinds:
                mix(x, mix.new_state(3), 0)
            ops.swiglu(x, x, x)
            ops.swiglu_rows(x, x, x)

    def forward(
        self, ids, state: SequenceState, all_logits: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """Run tokens at positions state.n..; returns logits (vocab,) of the last one, or (m, vocab) of all.
        Tokens go in chunks of `ubatch` (prefill), each committed to the state once it has run through every
        layer; progress(done, total) follows each one when there are several."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise StreamerError("no tokens to run (the prompt is empty)")
        self._check(ids, [state], [len(ids)])
        outs = []
        with interrupts.deferred():  # Ctrl-C lands between layers, not inside an expert read's bookkeeping
            for s in range(0, len(ids), self.ubatch):
                chunk = ids[s : s + self.ubatch]
                last = s + self.ubatch >= len(ids)
                x = self._layers(chunk, state)
                if all_logits:
                    outs.append(self._head(x))
                elif last:
                    outs.append(self._head(x[-1:])[0])
                if progress is not None and len(ids) > self.ubatch:
                    progress(s + len(chunk), len(ids))
        return np.concatenate(outs) if all_logits else outs[0]

    def step(self, ids, states: list[SequenceState]) -> np.ndarray:
        """One decode step of several sequences: token ids[b] at the end of states[b], for every b; returns
        their logits (B, vocab). Per layer each sequence's token mixes with its own state (through its one-call
        attention block where the model has them, else Mixer.step), then the FFN runs all B tokens: a streamed
        MoE reads the union of their experts once and computes each expert for every token routed to it; a
        resident MoE and a dense FFN with blocks compute each token as its one-token step does. A sequence's
        logits are those of its own one-token forward within the kernels' error (the same bits for block
        formats up to 3 sequences). All or nothing, like forward: no state moves unless every layer ran."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(states) or len({id(s) for s in states}) != len(states):
            raise StreamerError("a decode step needs one token for each of distinct sequences")
        if len(ids) == 1:
            return self.forward(ids, states[0])[None]
        self._check(ids, states, [1] * len(states))
        cfg, positions = self.cfg, [s.n for s in states]
        x = self.embd.rows(ids)
        h = np.empty_like(x)
        with interrupts.deferred():
            for i, L in enumerate(self.layers):
                interrupts.check()
                if self._decode is not None:  # each sequence's attention as its one-token step computes it
                    self._attend_rows(i, x, h, states, positions)
                else:
                    ops.rmsnorm(x, L.attn_norm, cfg.rms_eps, h)
                    x += L.mixer.step(h, [s.layers[i] for s in states], positions)
                for hook in self.hooks:
                    hook.after_attention(i, x)
                ops.rmsnorm(x, L.ffn_norm, cfg.rms_eps, h)
                if self.ffn_decodes_in_blocks:  # a dense FFN: each row as its one-token step's block
                    for b in range(len(ids)):
                        decode.ffn_block(x[b : b + 1], h[b : b + 1], *self._decode[2][i])
                elif hasattr(self.ffn, "decode"):  # a MoE: decode semantics (cache growth, lookahead) for B tokens
                    self.ffn.decode(i, h, x)
                else:
                    x += self.ffn(i, h)
            for s in states:
                s.commit(1)
        return linear_few(self.head, ops.rmsnorm(x, self.out_norm, cfg.rms_eps, np.empty_like(x)))

    def forward_many(self, chunks: list, states: list[SequenceState]) -> np.ndarray:
        """Several sequences' tokens in one forward: chunks[b] at the end of states[b]; returns the logits of
        each chunk's last token (B, vocab). One sequence is its forward; one token each is a decode step (step).
        Otherwise a prompt pass: per
        layer each sequence's tokens mix with its own state, as its own forward would, and the FFN runs every
        token at once (a MoE reads the union of their experts once: several prompts share their reads). At
        most Model.ubatch tokens in all. All or nothing, like forward."""
        chunks = [np.asarray(c, dtype=np.int64).reshape(-1) for c in chunks]
        if len(chunks) != len(states) or len({id(s) for s in states}) != len(states):
            raise StreamerError("a forward of several sequences needs one chunk for each of distinct sequences")
        lens = np.array([len(c) for c in chunks])
        if (lens == 0).any():
            raise StreamerError("no tokens to run (a chunk is empty)")
        if len(chunks) == 1:
            return self.forward(chunks[0], states[0])[None]
        if (lens == 1).all():
            return self.step(np.concatenate(chunks), states)
        if lens.sum() > self.ubatch:
            raise StreamerError(f"{lens.sum()} tokens in one forward, more than the chunk size {self.ubatch}")
        ids = np.concatenate(chunks)
        self._check(ids, states, lens)
        cfg, bounds = self.cfg, np.concatenate(([0], np.cumsum(lens)))
        x = self.embd.rows(ids)
        h = np.empty_like(x)
        with interrupts.deferred():
            for i, L in enumerate(self.layers):
                interrupts.check()
                ops.rmsnorm(x, L.attn_norm, cfg.rms_eps, h)
                for b, st in enumerate(states):
                    a, e = bounds[b], bounds[b + 1]
                    x[a:e] += L.mixer(h[a:e], st.layers[i], st.n)
                ops.rmsnorm(x, L.ffn_norm, cfg.rms_eps, h)
                x += self.ffn(i, h)
            for s, m in zip(states, lens):
                s.commit(int(m))
        last = x[bounds[1:] - 1]
        return linear_few(self.head, ops.rmsnorm(last, self.out_norm, cfg.rms_eps, np.empty_like(last)))

    def _check(self, ids: np.ndarray, states: list[SequenceState], lens) -> None:
        """Before any work: the tokens in the vocabulary, the file unchanged, room in each state for its lens[b]."""
        if ids.min() < 0 or ids.max() >= self.cfg.n_vocab:
            self.cfg.check_tokens(ids)
        if self.watch is not None:
            self.watch.check()
        for s, m in zip(states, lens):
            s.check_room(int(m))

    def _attend_rows(self, i: int, x: np.ndarray, h: np.ndarray, states: list[SequenceState], positions) -> None:
        """Layer i's attention for a batched step, row by row as the one-call block (decode.attn_block) of each
        sequence's own one-token step: bit for bit its logits alone, and faster than the batch's projections
        at these sizes, the rows' second reads of a layer's weights coming from the CPU cache (2026-12-06, 4 rows:
        1.2 ms a layer against 1.9 through the int8 matmul)."""
        attn, scratch, _ = self._decode
        formats, weights = attn[i]
        for b, (st, pos) in enumerate(zip(states, positions)):
            kv = st.layers[i]
            decode.attn_block(x[b : b + 1], h[b : b + 1], pos, kv.k, kv.v, *formats, weights, scratch)

    def _head(self, x: np.ndarray) -> np.ndarray:
        h = ops.rmsnorm(x, self.out_norm, self.cfg.rms_eps, np.empty_like(x))
        return linear(self.head, h)

    def _layers(self, ids: np.ndarray, state: SequenceState) -> np.ndarray:
        """One chunk of tokens through every layer, like the reference forward: for each layer, the mixer on
        the normed residual, then the FFN on the normed residual."""
        cfg, m, pos0 = self.cfg, len(ids), state.n
        x = self.embd.rows(ids)
        h = np.empty_like(x)
        if m == 1 and self._decode is not None:
            self._decode_layers(x, h, state, pos0)
        else:
            decode_ffn = hasattr(self.ffn, "decode")
            for i, L in enumerate(self.layers):
                interrupts.check()
                ops.rmsnorm(x, L.attn_norm, cfg.rms_eps, h)
                x += L.mixer(h, state.layers[i], pos0)
                if m == 1:  # the lookahead guesses a decode step's next experts, not a prompt's
                    for hook in self.hooks:
                        hook.after_attention(i, x)
                ops.rmsnorm(x, L.ffn_norm, cfg.rms_eps, h)
                if m == 1 and decode_ffn:  # a MoE's one-token FFN: one kernel call where it can
                    self.ffn.decode(i, h, x)
                else:
                    x += self.ffn(i, h)
        state.commit(m)
        return x

    def _decode_layers(self, x: np.ndarray, h: np.ndarray, state: SequenceState, pos: int) -> None:
        """One token through every layer: the attention as one kernel call (decode.attn_block, with both norms),
        the FFN as one (decode.ffn_block, dense) or the FFN object's call; the same results as _layers' path."""
        attn, scratch, ffn = self._decode
        for i in range(len(self.layers)):
            interrupts.check()
            formats, weights = attn[i]
            kv = state.layers[i]
            decode.attn_block(x, h, pos, kv.k, kv.v, *formats, weights, scratch)
            for hook in self.hooks:
                hook.after_attention(i, x)
            if ffn is not None:
                decode.ffn_block(x, h, *ffn[i])
            elif hasattr(self.ffn, "decode"):
                self.ffn.decode(i, h, x)
            else:
                x += self.ffn(i, h)
