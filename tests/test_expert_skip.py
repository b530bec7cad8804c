"""Cache-aware expert skipping (--expert-skip W): the rule by hand, a streamed run against the float64
reference applying the rule by its definition (which experts were read, which skipped, the logits), its
composition with expert top-p, a no-op where every expert is resident, and the options' validation."""

import numpy as np
import pytest
from reference import Reference
from test_moe import PROMPT, cosines, run, slot_bytes

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.moe import apply_skip
from streamer.options import StreamOptions, load_preset
from streamer.session import open_model

N_PREFILL = 5  # as test_moe.run: one 5-token call, then one call per token


def test_skip_rule_by_hand():
    ids = np.array([[3, 5, 7, 9]])
    w = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)
    present = np.array([[False, False, True, False]])
    got_ids, got_w, skipped = apply_skip(ids, w, 0.2, present)
    # 9 is absent and below 0.2: skipped; 7 is below too but cached; 5 is absent but at 0.3
    assert got_ids.tolist() == [[3, 5, 7, -1]] and skipped.tolist() == [[False, False, False, True]]
    np.testing.assert_allclose(got_w, [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], rtol=1e-6)
    # the top expert stays whatever the threshold
    got_ids, got_w, _ = apply_skip(ids, w, 0.9, np.zeros((1, 4), bool))
    assert got_ids.tolist() == [[3, -1, -1, -1]] and got_w[0, 0] == pytest.approx(1.0)
    # shares, not raw weights: a total of 0.5 (no norm_topk_prob) halves what a weight is worth
    _, half_w, skipped = apply_skip(ids, w * 0.5, 0.2, present)
    assert skipped[0, 3] and half_w.sum() == pytest.approx(0.5)
    # nothing absent below the threshold: the same arrays, bit for bit
    same_ids, same_w, skipped = apply_skip(ids, w, 0.04, present)
    assert same_ids is ids and same_w is w and not skipped.any()


def test_skip_keeps_what_another_token_reads_and_top_p_drops():
    ids = np.array([[1, 2, 3, -1], [2, 4, 1, 6]])  # token 0's last slot dropped by expert top-p
    w = np.array([[0.6, 0.3, 0.1, 0.0], [0.55, 0.3, 0.1, 0.05]], np.float32)
    got_ids, got_w, skipped = apply_skip(ids, w, 0.12, np.zeros(ids.shape, bool))
    # token 0's 3 (0.1) goes; token 1's 1 (0.1) stays, token 0 reads it anyway; its 6 (0.05) goes
    assert got_ids.tolist() == [[1, 2, -1, -1], [2, 4, 1, -1]]
    assert skipped.tolist() == [[False, False, True, False], [False, False, False, True]]
    np.testing.assert_allclose(got_w.sum(axis=1), [1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("top_p,threshold", [(1.0, 0.2), (0.8, 0.3)])
def test_streamed_skipping_matches_the_reference(synth_model, qtype, top_p, threshold):
    """A cache with a slot for every expert and no prefetch: an expert is present exactly when an earlier
    call read it, so the reference can apply the rule by its definition."""
    path = synth_model("tiny-moe", qtype)
    n_layer, n_expert = 4, 16
    skip = {"threshold": threshold, "calls": [N_PREFILL] + [1] * (len(PROMPT) - N_PREFILL), "seen": set()}
    skip.update(skipped=0, unread=0)
    want = Reference(str(path)).logits(PROMPT, top_p=top_p, skip=skip)
    opts = StreamOptions(
        learn=False,
        prefetch=False,
        expert_top_p=top_p,
        expert_skip=threshold,
        expert_cache_bytes=n_layer * n_expert * slot_bytes(path),
    )
    s = open_model(path, opts)
    got = run(s)
    assert cosines(got, want).min() >= 0.999
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    tot = s.model.ffn.traffic.totals()
    assert skip["skipped"] > 0 and tot.skipped == skip["skipped"]
    assert set(s.model.ffn.source.cache.entries) == skip["seen"]  # what was read: exactly what was kept
    layout = ExpertLayout(s.gf, s.cfg)
    assert tot.skipped_bytes == skip["unread"] * layout.expert_bytes(0)
    assert tot.routed + tot.dropped + tot.skipped == len(PROMPT) * n_layer * 4
    assert 0 < tot.skipped_share < tot.skipped * threshold
    if top_p == 1.0:
        assert tot.dropped == 0


def test_resident_experts_are_never_skipped(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    exact = run(open_model(path, StreamOptions(stream=False, learn=False)))
    s = open_model(path, StreamOptions(stream=False, learn=False, expert_skip=0.5))
    assert np.array_equal(run(s), exact)
    assert s.model.ffn.traffic.totals().skipped == 0


def test_skipping_with_lookahead_reads_less(synth_model):
    """With prefetch on, the lookahead applies the rule too (what would be skipped is not read ahead)."""
    path = synth_model("tiny-moe", "Q8_0")
    reads = {}
    for threshold in (0.0, 0.3):
        s = open_model(path, StreamOptions(learn=False, expert_skip=threshold, expert_cache_bytes=8 * slot_bytes(path)))
        logits = run(s, n_prefill=1)
        assert np.isfinite(logits).all()
        r = s.model.ffn.traffic.report()
        reads[threshold] = r["read_bytes"]
        if threshold:
            assert r["totals"]["skipped"] > 0 and r["skipped_bytes_per_token"] > 0
            assert "skipped" in s.model.ffn.traffic.summary()
    assert reads[0.3] < reads[0.0]


def test_skip_option_is_validated():
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(StreamerError, match=r"--expert-skip must be in \[0, 1\)"):
            StreamOptions(expert_skip=bad)
    assert StreamOptions.build(None, expert_skip=0.05).expert_skip == 0.05


def test_skip_in_a_preset(tmp_path):
    p = tmp_path / "skip.toml"
    p.write_text("expert_skip = 0.05\n")
    assert load_preset(str(p)) == {"expert_skip": 0.05}
    assert StreamOptions.build(str(p)).expert_skip == 0.05
    assert StreamOptions.build(str(p), expert_skip=0.0).expert_skip == 0.0  # an explicit flag wins
    p.write_text("expert_skip = 2\n")
    with pytest.raises(StreamerError, match="expert-skip must be"):
        load_preset(str(p))
