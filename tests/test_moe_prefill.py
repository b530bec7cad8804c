"""The grouped MoE prefill (tokens grouped by expert, several experts per kernel call, kernels/grouped.py):
equal to the per-token decode path bit for bit where the math is the same (same routing, every expert
through the grouped kernels), logits of a whole-prompt prefill against the float64 reference at today's
tolerance whichever way experts are split between the grouped kernels and matmul, and streamed == resident
for whole-prompt prefills under small caches."""

import numpy as np
import pytest
from reference import Reference
from test_moe import PROMPT, cosines, slot_bytes

from streamer.options import StreamOptions
from streamer.session import open_model


class FixedRouter:
    """The router's decisions for a whole chunk, replayed row by row for the per-token calls."""

    def __init__(self, router, ids, w):
        self.expert_top_p, self.ids, self.w, self.row = router.expert_top_p, ids, w, None

    def __call__(self, layer, h):
        if self.row is None:
            return self.ids, self.w
        return self.ids[self.row : self.row + 1], self.w[self.row : self.row + 1]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("grouped_max", [1000, 3])
def test_grouped_prefill_equals_per_token_path(synth_model, qtype, grouped_max):
    s = open_model(synth_model("tiny-moe", qtype), StreamOptions(stream=False, learn=False))
    ffn = s.moe
    ffn.tuning.grouped_max = grouped_max
    h = np.random.default_rng(0).standard_normal((6, s.cfg.n_embd)).astype(np.float32)
    n_matmul = n_exact = 0
    for layer in range(s.cfg.n_layer):
        ids, w = ffn.router(layer, h)
        router, ffn.router = ffn.router, FixedRouter(ffn.router, ids, w)
        try:
            chunk = ffn(layer, h)
            per_token = []
            for i in range(len(h)):
                ffn.router.row = i
                per_token.append(ffn(layer, h[i : i + 1]))
        finally:
            ffn.router = router
        per_token = np.concatenate(per_token)
        counts = np.bincount(ids.reshape(-1), minlength=s.cfg.n_expert)
        big = np.flatnonzero(counts > grouped_max)
        exact = ~np.isin(ids, big).any(axis=1)  # tokens whose experts all went through the grouped kernels
        n_matmul += len(big)
        n_exact += exact.sum()
        assert np.array_equal(chunk[exact], per_token[exact]), layer
        np.testing.assert_allclose(chunk, per_token, rtol=0, atol=2e-2 * np.abs(per_token).max())
    assert n_exact > 0
    if grouped_max == 3:
        assert n_matmul > 0  # the mixed case did send experts through matmul


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("grouped_max", [0, 2, 1000])
def test_whole_prompt_prefill_matches_float64_reference(synth_model, qtype, grouped_max):
    path = synth_model("tiny-moe", qtype)
    s = open_model(path, StreamOptions(stream=False, learn=False))
    s.moe.tuning.grouped_max = grouped_max
    got = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)
    want = Reference(str(path)).logits(PROMPT)
    assert cosines(got, want).min() >= 0.999
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("grouped_max", [2, 1000])
def test_streamed_whole_prompt_prefill_is_bit_identical_to_resident(synth_model, grouped_max):
    path = synth_model("tiny-moe", "Q4_K")
    s = open_model(path, StreamOptions(stream=False, learn=False))
    s.moe.tuning.grouped_max = grouped_max
    resident = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)
    sb = slot_bytes(path)
    for slots in (4, 7, 24, 64):
        st = open_model(path, StreamOptions(learn=False, expert_cache_bytes=slots * sb))
        st.moe.tuning.grouped_max = grouped_max
        got = st.model.forward(PROMPT, st.model.new_state(), all_logits=True)
        assert np.array_equal(got, resident), slots
        assert st.moe.source.cache.census()["in_use"] == 0
        st.close()
