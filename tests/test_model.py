"""The dense forward pass against the float64 reference (tests/reference.py), and the KV cache against
full recomputation."""

import numpy as np
import pytest
from reference import Reference

from streamer.session import open_model

PROMPT = np.array([1, 5, 200, 17, 99, 3, 250, 8, 8, 42, 7], dtype=np.int64)


def cosines(a, b):
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# Q8_0/F16/BF16: the only error is float32 accumulation (and int8 activation rounding if the kernels quantize x),
# ~1e-4 relative after 2 layers: 0.999 per position leaves a wide margin yet fails on any wrong scale, row,
# RoPE pairing or head mapping (those give cosines near 0). K-quants carry the same float32 arithmetic; their
# weights are exact in both paths (gguf-py dequantizes the same bytes), so the same bound holds.
@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "BF16", "Q4_K", "Q5_K", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_float64_reference(synth_model, qtype, tied):
    path = synth_model("tiny", qtype, tied=tied)
    s = open_model(path)
    got = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)
    want = Reference(str(path)).logits(PROMPT)
    assert got.shape == (len(PROMPT), s.cfg.n_vocab)
    assert cosines(got, want).min() >= 0.999
    # and the scale is right, not just the direction
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_cached_decode_equals_full_recompute(synth_model, qtype):
    s = open_model(synth_model("tiny", qtype))
    full = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)
    cache = s.model.new_state()
    # a 4-token prefill, then one token at a time through the cache
    steps = [s.model.forward(PROMPT[:4], cache, all_logits=True)]
    steps += [s.model.forward(PROMPT[i : i + 1], cache, all_logits=True) for i in range(4, len(PROMPT))]
    steps = np.concatenate(steps)
    tol = 1e-3 * np.abs(full).max()  # matvec vs matmul kernels round differently; same math
    assert np.abs(steps - full).max() <= tol
    assert cache.n == len(PROMPT)


def test_prefill_returns_last_position_and_chunks(synth_model):
    s = open_model(synth_model("tiny", "Q8_0"))
    full = s.model.forward(PROMPT, s.model.new_state(), all_logits=True)
    s.model.ubatch = 3  # force several prefill chunks
    seen = []
    last = s.model.forward(PROMPT, s.model.new_state(), progress=lambda done, total: seen.append((done, total)))
    n = len(PROMPT)
    assert seen == [(min(i + 3, n), n) for i in range(0, n, 3)]
    assert np.abs(last - full[-1]).max() <= 1e-3 * np.abs(full).max()


def test_truncate_then_continue_matches(synth_model):
    s = open_model(synth_model("tiny", "Q8_0"))
    cache = s.model.new_state()
    s.model.forward(PROMPT, cache)
    cache.truncate(5)  # rewind, then feed a different continuation
    alt = np.array([11, 12, 13], dtype=np.int64)
    got = s.model.forward(alt, cache, all_logits=True)
    want = s.model.forward(np.concatenate([PROMPT[:5], alt]), s.model.new_state(), all_logits=True)[5:]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_context_overflow_and_bad_tokens_are_user_errors(synth_model):
    from streamer.errors import StreamerError

    s = open_model(synth_model("tiny", "Q8_0"), n_ctx=8)
    cache = s.model.new_state()
    with pytest.raises(StreamerError, match="context overflow"):
        s.model.forward(PROMPT, cache)
    n = s.cfg.n_vocab
    with pytest.raises(StreamerError, match=f"token id {n} is out of range"):
        s.model.forward(np.array([1, n]), s.model.new_state())
    with pytest.raises(StreamerError, match="token id -1"):
        s.model.forward(np.array([-1]), s.model.new_state())


def test_long_prompt_progress_gives_the_same_results(synth_model):
    """A prompt of several prefill chunks, fed chunk by chunk to report progress, fills the cache exactly as
    one forward does, and an interrupted chunk rolls the whole prompt back."""
    from streamer.generate import Generator
    from streamer.sampler import Sampler, SamplerParams

    s = open_model(synth_model("tiny", "Q8_0"), n_ctx=2048)
    ids = list(np.random.default_rng(1).integers(0, s.cfg.n_vocab, 1100))
    more = ids[:700]  # a second prompt after the first: 1800 of 2048 positions
    plain = Generator(s.model, s.model.new_state(), Sampler(SamplerParams()))
    calls = []
    shown = Generator(
        s.model,
        s.model.new_state(),
        Sampler(SamplerParams()),
        on_prefill=lambda done, total: calls.append((done, total)),
    )
    assert np.array_equal(plain.feed(ids), shown.feed(ids))
    assert calls == [(512, 1100), (1024, 1100), (1100, 1100)]
    n = plain.state.n
    for a, b in zip(plain.state.layers, shown.state.layers):
        assert np.array_equal(a.k[:, :n], b.k[:, :n]) and np.array_equal(a.v[:, :n], b.v[:, :n])

    def stop(done, total):
        if done == 512:
            raise KeyboardInterrupt

    shown.on_prefill = stop
    with pytest.raises(KeyboardInterrupt):
        shown.feed(more)
    assert shown.state.n == n and shown.history == plain.history  # as before the interrupted prompt
