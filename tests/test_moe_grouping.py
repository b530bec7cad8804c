"""The MoE prefill's batched expert matmuls: int8.grouped_matmul (every expert of a group, gate and up or down,
in one parallel call, on activation rows padded per expert) against int8.matmul called per expert (itself
checked against gguf-py in test_int8.py), bit for bit; and the MoE layer on a hand-made routing (experts with
0, 1, 3, 4, 5 and all tokens, a dropped slot) against a float64 FFN over gguf-py's dequantized weights, for
each kernel the prefill can take (vpdpbusd, the generic integer kernel, the f32 tiles; Q4_K experts with 4..16
tokens by lanes.grouped or by the tiles), and streamed == resident bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from reference import Reference
from test_kernels import make_weight
from test_moe import slot_bytes
from test_moe_prefill import FixedRouter

from streamer.formats import FORMATS
from streamer.kernels import int8
from streamer.options import StreamOptions
from streamer.session import open_model

COUNTS = [0, 1, 3, 4, 5, 9, 0, 2]  # tokens per expert of the group


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("isa", int8.usable_isas())
@pytest.mark.parametrize(
    "qtype,n_out,n_in", [(T.Q4_K, 64, 512), (T.Q6_K, 48, 256), (T.Q8_0, 40, 64), (T.Q4_0, 32, 96), (T.Q5_K, 32, 256)]
)
def test_grouped_matmul_equals_matmul_per_expert(qtype, n_out, n_in, isa, digits):
    rng = np.random.default_rng(7)
    fmt, g, m = FORMATS[qtype].code, len(COUNTS), 12
    if not int8.serves(fmt, isa):
        pytest.skip(f"{isa}'s kernel does not serve {qtype.name}")
    mats = [make_weight(qtype, n_out, n_in, rng)[0].view(np.uint8) for _ in range(2 * g)]
    row_bytes = mats[0].shape[1]
    gap = 3 * row_bytes  # experts not packed back to back: offsets are honoured
    base = np.zeros(2 * g * (n_out * row_bytes + gap), np.uint8)
    offs = (np.arange(2 * g) * (n_out * row_bytes + gap)).reshape(2, g)
    for mat, o in zip(mats, offs.reshape(-1)):
        base[o : o + mat.size] = mat.reshape(-1)
    base.flags.writeable = False  # as the file's mapping and the expert cache's arena view: the run's kernel version
    X = rng.standard_normal((m, n_in)).astype(np.float32)
    X[3] = 0.0
    toks = [np.sort(rng.choice(m, c, replace=False)) for c in COUNTS]
    padded = -(-np.array(COUNTS) // int8.N_TOK) * int8.N_TOK
    rstarts = np.concatenate(([0], np.cumsum(padded)))
    rows = np.full(rstarts[-1], -1)
    for i, t in enumerate(toks):
        rows[rstarts[i] : rstarts[i] + len(t)] = t
    out = np.full((2, rstarts[-1], n_out), np.nan, np.float32)
    act = int8.gather(int8.quantize(fmt, X, digits), rows)
    int8.grouped_matmul(fmt, base, offs, row_bytes, act, rstarts, out, isa, digits)
    for j in range(2):
        for i, t in enumerate(toks):
            want = np.empty((len(t), n_out), np.float32)
            int8.matmul(fmt, mats[j * g + i], X[t], want, isa, digits)
            assert np.array_equal(out[j, rstarts[i] : rstarts[i] + len(t)], want), (j, i)
            assert np.all(out[j, rstarts[i] + len(t) : rstarts[i + 1]] == 0)  # the padding rows


def _routing(m, n_expert, k, rng):
    """Expert 0 gets every token, 1 one, 2 three, 3 four, 4 five, 5 none; the other slots random among 6..;
    token 1's last slot dropped (id -1, weight 0, as expert top-p marks it)."""
    ids = np.full((m, k), -1, np.int64)
    ids[:, 0] = 0
    fixed = {1: [0], 2: [1, 2, 3], 3: [4, 5, 6, 7], 4: [8, 9, 10, 11, 12]}
    for e, ts in fixed.items():
        ids[ts, 1] = e
    for t in range(m):
        have = [e for e in ids[t] if e >= 0]
        ids[t, len(have) :] = rng.choice(np.arange(6, n_expert), k - len(have), replace=False)
    w = rng.uniform(0.1, 1.0, (m, k)).astype(np.float32)
    ids[1, -1], w[1, -1] = -1, 0.0
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def _ffn64(ref, layer, h, ids, w):
    W = ref.w
    G, U, D = (W[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    out = np.zeros(h.shape, np.float64)
    x = h.astype(np.float64)
    for t in range(len(h)):
        for e, we in zip(ids[t], w[t]):
            if e >= 0:
                g = G[e] @ x[t]
                out[t] += float(we) * ((g / (1 + np.exp(-g)) * (U[e] @ x[t])) @ D[e].T)
    return out


def _chunk(session, layer, h, ids, w):
    ffn = session.moe
    router, ffn.router = ffn.router, FixedRouter(ffn.router, ids, w)
    try:
        return ffn(layer, h)
    finally:
        ffn.router = router


@pytest.mark.parametrize("lanes_max", [0, 16])  # Q4_K experts with 4..16 tokens: lanes.grouped, or the tiles
@pytest.mark.parametrize("grouped_max", [0, 3])
@pytest.mark.parametrize("isa", int8.usable_isas() + [None], ids=lambda i: i or "f32-tiles")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_moe_prefill_grouping_against_float64(synth_model, monkeypatch, qtype, isa, grouped_max, lanes_max):
    path = synth_model("tiny-moe", qtype)
    monkeypatch.setattr(int8, "ISA", isa)
    s = open_model(path, StreamOptions(stream=False, learn=False))
    s.moe.tuning.grouped_max = grouped_max
    s.moe.tuning.lanes_max = lanes_max
    cfg, ref, rng = s.cfg, Reference(str(path)), np.random.default_rng(3)
    m = 20
    for layer in range(cfg.n_layer):
        ids, w = _routing(m, cfg.n_expert, cfg.n_expert_used, rng)
        h = rng.standard_normal((m, cfg.n_embd)).astype(np.float32)
        got = _chunk(s, layer, h, ids, w)
        want = _ffn64(ref, layer, h, ids, w)
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), layer
    s.close()


@pytest.mark.parametrize("grouped_max", [0, 3])
def test_moe_prefill_grouping_streamed_equals_resident(synth_model, grouped_max):
    path = synth_model("tiny-moe", "Q4_K")
    s = open_model(path, StreamOptions(stream=False, learn=False))
    s.moe.tuning.grouped_max = grouped_max
    rng = np.random.default_rng(5)
    m, cfg = 20, s.cfg
    cases = [(layer, *_routing(m, cfg.n_expert, cfg.n_expert_used, rng)) for layer in range(cfg.n_layer)]
    h = rng.standard_normal((m, cfg.n_embd)).astype(np.float32)
    resident = [_chunk(s, layer, h, ids, w) for layer, ids, w in cases]
    for slots in (4, 7, 64):
        st = open_model(path, StreamOptions(learn=False, expert_cache_bytes=slots * slot_bytes(path)))
        st.moe.tuning.grouped_max = grouped_max
        for (layer, ids, w), want in zip(cases, resident):
            assert np.array_equal(_chunk(st, layer, h, ids, w), want), (slots, layer)
        assert st.moe.source.cache.census()["in_use"] == 0
        st.close()
    s.close()
