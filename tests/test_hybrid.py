"""The hybrid MoE architectures, qwen35moe (Qwen3.5 / Qwen3.6 MoE) and qwen3next (Qwen3-Next): gated attention
and Gated DeltaNet layers with a shared expert. Logits
against the float64 reference (tests/reference.py, after llama.cpp's graph), streamed == resident bit for bit,
the recurrent state's rollback and saved points (an interrupted forward, a 2-turn chat, the server's prefix
reuse), and one-line errors for what is not supported."""

import numpy as np
import pytest
from reference import Reference, cosines

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.generate import Generator
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.session import open_model
from streamer.state import SAVED_MAX, Recurrent

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64, 300, 7, 7, 380], dtype=np.int64)


def run(s, tokens=PROMPT, n_prefill=6):
    """Prefill n_prefill tokens, then one at a time (decode): all-position logits."""
    st = s.model.new_state()
    out = [s.model.forward(tokens[:n_prefill], st, all_logits=True)]
    out += [s.model.forward(tokens[i : i + 1], st, all_logits=True) for i in range(n_prefill, len(tokens))]
    return np.concatenate(out)


def assert_continues(s, st, stop):
    """Feeding PROMPT[st.n:stop] on st gives, to float32 rounding, a fresh prefill's logits at those positions."""
    start = st.n
    got = s.model.forward(PROMPT[start:stop], st, all_logits=True)
    want = s.model.forward(PROMPT[:stop], s.model.new_state(), all_logits=True)[start:]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize(
    "preset,qtype,recipe",
    [
        ("tiny-qwen35moe", "Q8_0", None),
        ("tiny-qwen35moe", "Q8_0", "Q4_K_M"),
        pytest.param("tiny-qwen35moe", "BF16", None, marks=pytest.mark.slow),  # float experts: test_moe's fast case
        ("tiny-qwen3next", "Q8_0", None),
        pytest.param("tiny-qwen3next", "Q8_0", "Q4_K_M", marks=pytest.mark.slow),
    ],
)
def test_tiny_hybrids_match_float64_reference(synth_model, preset, qtype, recipe):
    path = synth_model(preset, qtype, recipe=recipe)
    s = open_model(path, StreamOptions(stream=False, learn=False))
    kinds = [type(L.mixer).__name__ for L in s.model.layers]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "GatedDeltaNet", "GatedAttention"]
    got = run(s)
    want = Reference(str(path)).logits(PROMPT)
    cos = cosines(got, want)
    # Position 0 from an empty state: o = beta v (k . q), and on random weights k . q may nearly cancel (tiny-qwen3next's
    # layer 2: mean squares 1e-8 against the gated norm's eps of 1e-6), so float32 and float64 part there; llama.cpp
    # lands as far (cosine 0.9984 to the reference, 0.9999 to stream-run; 2026-12-05, bench/hybrid_parity.py).
    assert cos[0] >= 0.995 and cos[1:].min() >= 0.999, cos
    assert (got.argmax(1) == want.argmax(1))[1:].mean() >= (0.98 if recipe is None else 0.9)


@pytest.mark.parametrize("preset", ["tiny-qwen35moe", "tiny-qwen3next"])
def test_the_linear_attention_matters(synth_model, preset):
    """Guards against a mixer silently skipped: zeroing the delta rule's output moves the logits far."""
    path = synth_model(preset, "Q8_0")
    s = open_model(path, StreamOptions(stream=False, learn=False))
    want = Reference(str(path)).logits(PROMPT)
    got = run(s)
    for L in s.model.layers[:3]:
        L.mixer.norm = np.zeros_like(L.mixer.norm)
    off = run(s)
    assert np.abs(off - want)[1:].max() > 20 * np.abs(got - want)[1:].max()  # position 0: see above


@pytest.mark.parametrize("preset", ["tiny-qwen35moe", pytest.param("tiny-qwen3next", marks=pytest.mark.slow)])
def test_streamed_equals_resident_bit_for_bit(synth_model, preset):
    path = synth_model(preset, "Q8_0", recipe="Q4_K_M")
    r = open_model(path, StreamOptions(stream=False, learn=False))
    r.moe.source.resident()  # every expert in RAM: a token's routed experts are one kernel call per layer
    resident = run(r)
    assert r.moe.whole_layer._dec is not None  # that one-call path (MoEFFN.decode) was taken
    slot = ExpertLayout(r.gf, r.cfg).slot_bytes
    for slots in (5, 24):
        s = open_model(path, StreamOptions(learn=False, expert_cache_bytes=slots * slot))
        assert s.moe.source.streams
        np.testing.assert_array_equal(run(s), resident)


def test_state_sizes_are_what_the_budget_charges(synth_model):
    s = open_model(synth_model("tiny-qwen35moe", "Q8_0"), StreamOptions(stream=False, learn=False), n_ctx=256)
    st = s.model.new_state()
    recurrent = [x for x in st.layers if isinstance(x, Recurrent)]
    assert len(recurrent) == 3 and len(st.layers) == 4
    c = s.cfg
    # one copy: conv window (K-1) x channels, plus per value head a d x d matrix, float32
    assert c.recurrent_bytes == 3 * 4 * ((c.ssm_conv - 1) * (2 * 2 + 4) * 32 + 4 * 32 * 32)
    assert st.nbytes == 256 * c.kv_bytes_per_token + 2 * c.recurrent_bytes  # committed + in progress
    assert c.kv_bytes_per_token == 2 * 1 * 2 * 64 * 2  # one attention layer of 4
    for i in range(SAVED_MAX + 2):  # more saved points than are kept: the oldest go
        s.model.forward(PROMPT[i : i + 1], st)
        st.save()
    assert st.nbytes == c.state_bytes(256)  # what the budget charges: K/V, two copies, SAVED_MAX snapshots


def test_an_interrupted_forward_leaves_the_state_as_it_was(synth_model):
    s = open_model(synth_model("tiny-qwen35moe", "Q8_0"), StreamOptions(stream=False, learn=False))
    st = s.model.new_state()
    s.model.forward(PROMPT[:5], st)
    calls = []

    def stop(layer, x):
        calls.append(layer)
        if layer == 2:  # two linear-attention layers have run and written their new state
            raise KeyboardInterrupt

    s.model.hooks.append(type("Hook", (), {"after_attention": staticmethod(stop)})())
    with pytest.raises(KeyboardInterrupt):
        s.model.forward(PROMPT[5:6], st)
    s.model.hooks.pop()
    assert calls == [0, 1, 2] and st.n == 5
    assert_continues(s, st, 8)


def test_truncate_returns_only_to_saved_points(synth_model):
    s = open_model(synth_model("tiny-qwen35moe", "Q8_0"), StreamOptions(stream=False, learn=False))
    gen = Generator(s.model, s.model.new_state(), Sampler(SamplerParams(temperature=0.0)))
    gen.feed(PROMPT[:6])  # saved at 0 and 6
    gen.feed(PROMPT[6:10])  # saved at 6 and 10
    st = gen.state
    assert [st.restorable(n) for n in (0, 3, 6, 8, 10, 12)] == [0, 0, 6, 6, 10, 10]
    with pytest.raises(StreamerError, match="cannot return to position 8"):
        st.truncate(8)
    st.truncate(6)  # back to the first prompt's end: the second prompt again gives the same logits
    assert_continues(s, st, 10)


def test_two_turns_equal_one_long_prefill(synth_model):
    """A chat's second turn continues the recurrent state: its logits are those of one prefill of both."""
    s = open_model(synth_model("tiny-qwen35moe", "Q8_0"), StreamOptions(stream=False, learn=False))
    gen = Generator(s.model, s.model.new_state(), Sampler(SamplerParams(temperature=0.0)))
    first = list(gen.generate(PROMPT[:6], 4))
    turn2 = gen.feed(PROMPT[6:12])
    hist = gen.history
    assert hist[6:10] == first and len(hist) == 16  # the last reply token was pending: fed with the second turn
    want = s.model.forward(np.asarray(hist), s.model.new_state())
    np.testing.assert_allclose(turn2, want, rtol=0, atol=2e-3 * np.abs(want).max())


def renamed(src, dst, old: str, new: str):
    """A copy of the GGUF src at dst with `old` replaced by `new` in every tensor name."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(
            f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        )
    for t in r.tensors:
        w.add_tensor(t.name.replace(old, new), np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_merged_gate_up_tensor_of_the_wrong_shape_is_one_clear_error(synth_model, tmp_path):
    """gate renamed ffn_gate_up_exps keeps gate's rows, half of what a merged tensor has (test_merged_experts.py
    runs well-formed ones)."""
    path = renamed(synth_model("tiny-qwen35moe", "Q8_0"), tmp_path / "m.gguf", "ffn_gate_exps", "ffn_gate_up_exps")
    with pytest.raises(StreamerError, match="tensor 'blk.0.ffn_gate_up_exps.weight' has shape .*, expected"):
        open_model(path, StreamOptions(stream=False))


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3next_attn_qkv_and_gate_equal_ssm_in(synth_model, stream):
    """Newer converters write a qwen3next linear-attention layer's ssm_in as attn_qkv (every head's q, k, v) and
    attn_gate (z), ssm_ba unchanged; synth --split-ssm-in draws the same weights: the same logits bit for bit, and
    the float64 reference on the split file (gguf-py's reader, its own head mapping) agrees."""
    old = synth_model("tiny-qwen3next", "Q8_0")
    new = synth_model("tiny-qwen3next", "Q8_0", split_ssm_in=True)
    a = open_model(old, StreamOptions(stream=False, learn=False))
    opts = StreamOptions(learn=False, expert_cache_bytes=5 * ExpertLayout(a.gf, a.cfg).slot_bytes)
    b = open_model(new, opts if stream else StreamOptions(stream=False, learn=False))
    assert "blk.0.attn_qkv.weight" in b.gf.tensors and "blk.0.ssm_in.weight" not in b.gf.tensors
    assert b.moe.source.streams == stream
    got = run(b)
    np.testing.assert_array_equal(got, run(a))
    cos = cosines(got, Reference(str(new)).logits(PROMPT))
    assert cos[0] >= 0.995 and cos[1:].min() >= 0.999, cos  # position 0: see test_tiny_hybrids_match_float64_reference


def test_a_split_ssm_in_of_the_wrong_shape_is_one_clear_error(synth_model, tmp_path):
    """ssm_in renamed attn_qkv keeps z's rows too: one line naming the tensor and both shapes."""
    path = renamed(synth_model("tiny-qwen3next", "Q8_0"), tmp_path / "n.gguf", "ssm_in", "attn_qkv")
    with pytest.raises(
        StreamerError, match=r"tensor 'blk.0.attn_qkv.weight' has shape \[384, 256\], expected \[256, 256\]"
    ):
        open_model(path, StreamOptions(stream=False))


def test_synth_splits_ssm_in_of_qwen3next_only(tmp_path):
    from typer.testing import CliRunner

    from streamer.cli.main import app

    r = CliRunner().invoke(app, ["synth", str(tmp_path / "x.gguf"), "--preset", "tiny-qwen35moe", "--split-ssm-in"])
    assert r.exit_code == 2 and "is not a qwen3next model" in r.output and not (tmp_path / "x.gguf").exists()
    r = CliRunner().invoke(app, ["synth", str(tmp_path / "y.gguf"), "--preset", "tiny-qwen3next", "--split-ssm-in"])
    assert r.exit_code == 0, r.output
    from streamer.gguf_file import GGUFFile

    names = GGUFFile(str(tmp_path / "y.gguf")).tensors
    assert "blk.0.attn_gate.weight" in names and "blk.0.ssm_ba.weight" in names and "blk.0.ssm_in.weight" not in names


def test_a_padded_vocabulary_keeps_the_tokenizer(tmp_path):
    """synth's n_vocab (Qwen3.5's 248,320 rows over a smaller tokenizer) adds unused tokens only."""
    from dataclasses import replace

    from streamer.synth.writer import spec_for, write_model

    spec = spec_for("tiny-qwen35moe", "Q8_0", real_vocab=False)
    plain = write_model(tmp_path / "a.gguf", spec)
    padded = write_model(tmp_path / "b.gguf", replace(spec, geometry=replace(spec.geometry, n_vocab=1024)))
    a = open_model(plain, StreamOptions(stream=False, learn=False))
    b = open_model(padded, StreamOptions(stream=False, learn=False))
    assert (a.cfg.n_vocab, b.cfg.n_vocab) == (381, 1024)
    text = "def f(x):\n    return x + 1  # é"
    assert b.tokenizer.encode_raw(text) == a.tokenizer.encode_raw(text)
    assert b.tokenizer.decode([400, 1000]) == ""  # unused tokens render nothing, as llama.cpp's
