"""kernels/decode.py's one-call decode blocks against the per-call path they replace (the same kernels on the
same quantized activations: float32 rounding apart), streamed == resident bit for bit through them, and the
decode steps against the float64 reference."""

import numpy as np
import pytest
from reference import Reference, cosines

from streamer.kernels._bits import f32_to_f16_bits
from streamer.options import StreamOptions
from streamer.session import open_model

PROMPT = np.array([1, 5, 200, 17, 99, 3, 250, 8, 8, 42, 7], dtype=np.int64)


def steps(model, n_prefill=4):
    """Logits of a prefill of n_prefill tokens, then each further token as a one-token step."""
    cache = model.new_state()
    out = [model.forward(PROMPT[:n_prefill], cache, all_logits=True)]
    out += [model.forward(PROMPT[i : i + 1], cache, all_logits=True) for i in range(n_prefill, len(PROMPT))]
    return np.concatenate(out), cache


@pytest.mark.parametrize(
    "preset,qtype,kw",
    [
        ("tiny", "Q8_0", {}),
        ("tiny", "Q4_K", {}),
        ("tiny", "Q4_K", {"tied": True}),
        ("tiny-qwen2", "Q4_K", {}),  # q/k/v biases, RoPE without the per-head norm
        ("tiny-moe", "Q4_K", {}),
    ],
)
def test_decode_blocks_equal_per_call_path(synth_model, preset, qtype, kw):
    s = open_model(synth_model(preset, qtype, **kw), StreamOptions(stream=False))
    assert s.model._decode is not None  # block formats: the one-call blocks are used
    fused, c1 = steps(s.model)
    plan, s.model._decode = s.model._decode, None
    try:
        per_call, c2 = steps(s.model)
    finally:
        s.model._decode = plan
    # The same kernels on the same activations, but blocks.prepare inlined into another kernel may round its
    # scales in the last bit (arcp/contract): float32 rounding apart, not bit for bit (streamed and resident
    # runs both take the one-call path: that guarantee is tested below and in test_moe).
    assert np.abs(fused - per_call).max() <= 1e-3 * np.abs(per_call).max()  # as test_model: kernels round differently
    n = len(PROMPT)
    for a, b in [(x.k[:, :n], y.k[:, :n]) for x, y in zip(c1.layers, c2.layers)] + [
        (x.v[:, :n], y.v[:, :n]) for x, y in zip(c1.layers, c2.layers)
    ]:
        a, b = a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32)
        assert np.abs(a - b).max() <= 2e-3 * np.abs(b).max()
    want = Reference(str(synth_model(preset, qtype, **kw))).logits(PROMPT)
    cos = cosines(fused, want)
    assert cos.min() >= 0.999


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_moe_one_call_layer_equals_per_call_and_streamed(synth_model, qtype):
    """MoEFFN.decode's one kernel per layer (experts resident) against the per-call path (float32 rounding
    apart, same routing counts: traffic and learned usage) and a streamed run (bit for bit)."""
    path = synth_model("tiny-moe", qtype)
    runs = {}
    for name in ("one-call", "per-call"):
        s = open_model(path, StreamOptions(stream=False))
        s.moe.source.resident()
        if name == "per-call":  # every layer's calls one by one: no attention block, no MoEFFN.decode
            s.model._decode = None
            s.model.ffn = s.moe.__call__
        runs[name] = (steps(s.model)[0], s.moe.traffic.report()["totals"], s.moe.usage.counts.copy())
        assert (s.moe.whole_layer._dec is not None) == (name == "one-call")  # the path under test was taken
    (a, ta, ua), (b, tb, ub) = runs["one-call"], runs["per-call"]
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
    assert ta == tb and ua.sum() > 0 and np.array_equal(ua, ub)
    streamed = open_model(path, StreamOptions(learn=False, expert_cache_bytes=6 * 2**20))
    assert streamed.streaming
    assert np.array_equal(steps(streamed.model)[0], a)


def test_float_weights_keep_the_per_call_path(synth_model):
    s = open_model(synth_model("tiny", "F16"))
    assert s.model._decode is None
    got, _ = steps(s.model)
    want = Reference(str(synth_model("tiny", "F16"))).logits(PROMPT)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_f16_store_rounds_like_numpy():
    from numba import njit

    @njit
    def conv(x, out):
        for i in range(x.size):
            out[i] = f32_to_f16_bits(x[i])

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 10000),
            np.array([0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.98e-8, np.inf, -np.inf], np.float32),
            # halfway cases between neighbouring halves: ties to even
            (np.arange(1024, 2048, dtype=np.float32) + np.float32(0.5)) / np.float32(1024.0),
        ]
    )
    out = np.empty(x.size, np.uint16)
    conv(x, out)
    with np.errstate(over="ignore"):  # 1e6 -> inf, as intended
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(out, want)
