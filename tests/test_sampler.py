"""Sampler checks against distributions computed by hand from logits [2, 1, 0, -1]:
softmax = e^[2,1,0,-1] / 11.4752 = [0.64391, 0.23688, 0.08714, 0.03206]."""

import numpy as np
import pytest

from streamer.errors import StreamerError
from streamer.sampler import Sampler, SamplerParams, apply_penalties, filter_probs

LOGITS = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
P = np.array([0.64391, 0.23688, 0.08714, 0.03206])


def params(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    base.update(kw)
    return SamplerParams(**base)


def test_plain_softmax():
    ids, probs = filter_probs(LOGITS, params())
    assert list(ids) == [0, 1, 2, 3]
    np.testing.assert_allclose(probs, P, atol=1e-5)


def test_temperature():
    # temp 2: e^[1, .5, 0, -.5] = [2.71828, 1.64872, 1, 0.60653] / 5.97353
    ids, probs = filter_probs(LOGITS, params(temperature=2.0))
    np.testing.assert_allclose(probs, [0.45505, 0.27600, 0.16740, 0.10154], atol=1e-5)


def test_top_k():
    ids, probs = filter_probs(LOGITS, params(top_k=2))
    assert list(ids) == [0, 1]
    np.testing.assert_allclose(probs, [0.73106, 0.26894], atol=1e-5)


@pytest.mark.parametrize("top_p,kept", [(0.5, 1), (0.64, 1), (0.65, 2), (0.88, 2), (0.89, 3), (0.97, 4), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    # cumulative: 0.64391, 0.88079, 0.96794, 1.0
    ids, probs = filter_probs(LOGITS, params(top_p=top_p))
    assert len(ids) == kept
    np.testing.assert_allclose(probs, P[:kept] / P[:kept].sum(), atol=1e-5)


@pytest.mark.parametrize("min_p,kept", [(0.0, 4), (0.04, 4), (0.05, 3), (0.13, 3), (0.14, 2), (0.36, 2), (0.37, 1)])
def test_min_p_relative_to_top_probability(min_p, kept):
    # p / p_max: 1, 0.36788, 0.13534, 0.04979
    ids, _ = filter_probs(LOGITS, params(min_p=min_p))
    assert len(ids) == kept


def test_repetition_penalty_divides_positive_multiplies_negative():
    out = apply_penalties(LOGITS, [0, 3, 3], params(repeat_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, 1.0, 0.0, -2.0])


def test_frequency_and_presence_penalties_and_window():
    p = params(frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=3)
    out = apply_penalties(LOGITS, [2, 1, 1, 0], p)  # window = last 3 = [1, 1, 0]
    np.testing.assert_allclose(out, [2 - 0.5 - 0.25, 1 - 1.0 - 0.25, 0.0, -1.0])
    assert np.array_equal(apply_penalties(LOGITS, [0, 1], params(frequency_penalty=1.0, repeat_last_n=0)), LOGITS)


def test_greedy_ignores_filters_but_not_penalties():
    s = Sampler(SamplerParams(temperature=0.0, top_k=3, top_p=0.1))
    assert s(LOGITS) == 0
    s = Sampler(SamplerParams(temperature=0.0, repeat_penalty=4.0))
    assert s(LOGITS, [0]) == 1  # 2/4 = 0.5 < 1


def test_draws_follow_the_filtered_distribution():
    s = Sampler(params(top_k=3, seed=7))
    n = 40000
    counts = np.bincount([s(LOGITS) for _ in range(n)], minlength=4) / n
    want = np.append(P[:3] / P[:3].sum(), 0.0)
    # binomial standard error <= sqrt(.25 / 40000) = 0.0025: 4 sigma
    np.testing.assert_allclose(counts, want, atol=0.01)


def test_same_seed_same_tokens_other_seed_differs():
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal(1000).astype(np.float32) for _ in range(50)]
    a = [Sampler(params(seed=123))(l) for l in logits]
    b = [Sampler(params(seed=123))(l) for l in logits]
    s1, s2 = Sampler(params(seed=123)), Sampler(params(seed=124))
    assert [s1(l) for l in logits] != [s2(l) for l in logits]
    assert a == b


def test_bad_parameters_are_user_errors():
    with pytest.raises(StreamerError, match="top-p"):
        Sampler(params(top_p=1.5))
    with pytest.raises(StreamerError, match="min-p"):
        Sampler(params(min_p=-0.1))
