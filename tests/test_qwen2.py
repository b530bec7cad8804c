"""The qwen2 architecture (Qwen2.5 / Qwen2.5-Coder): q/k/v biases, no per-head q/k RMSNorm, head_dim from
embedding_length / head_count, tied embeddings on small sizes. A tiny qwen2 model against the float64
reference (extended for qwen2), and the file checks."""

import shutil
import struct

import numpy as np
import pytest
from forcing import PROMPT, run
from reference import Reference

from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.options import StreamOptions
from streamer.session import open_model
from streamer.synth.writer import spec_for, typed_tensors


@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q8_0", True), ("Q4_K", True)])
def test_tiny_qwen2_matches_float64_reference(synth_model, qtype, tied):
    path = synth_model("tiny-qwen2", qtype, tied=tied)
    s = open_model(path, StreamOptions(stream=False, learn=False))
    assert (s.cfg.arch, s.cfg.head_dim, s.cfg.tied) == ("qwen2", 64, tied)
    assert s.model.layers[0].mixer.q_norm is None and s.model.layers[0].mixer.bq is not None
    got = run(s)
    want = Reference(str(path)).logits(PROMPT)
    cos = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.999 and np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    # the biases matter: the same forward without them is far off (guards against biases silently ignored)
    for L in s.model.layers:
        L.mixer.bq = L.mixer.bk = L.mixer.bv = None
    off = run(s)
    assert np.abs(off - want).max() > 10 * np.abs(got - want).max()


def test_missing_bias_is_one_error_line(synth_model, tmp_path):
    src = synth_model("tiny-qwen2", "Q8_0")
    dst = tmp_path / "q.gguf"
    shutil.copy(src, dst)
    data = bytearray(dst.read_bytes())
    old = b"blk.1.attn_v.bias"
    i = data.find(struct.pack("<Q", len(old)) + old)
    assert i > 0
    data[i + 8 : i + 8 + len(old)] = b"blk.1.attn_v.xxxx"
    dst.write_bytes(data)
    with pytest.raises(StreamerError, match=r"missing tensor 'blk.1.attn_v.bias'"):
        ModelConfig.from_gguf(GGUFFile(dst))


def test_qwen25_coder_7b_preset_geometry():
    shapes = {n: s for n, s, _, _ in typed_tensors(spec_for("qwen2.5-coder-7b", "Q4_K", real_vocab=False), 1000)}
    assert shapes["blk.0.attn_q.weight"] == (3584, 3584) and shapes["blk.0.attn_k.weight"] == (512, 3584)
    assert shapes["blk.27.attn_k.bias"] == (512,) and shapes["blk.0.ffn_up.weight"] == (18944, 3584)
    assert "blk.0.attn_q_norm.weight" not in shapes and "blk.28.attn_q.weight" not in shapes


def test_chat_uses_qwen2_template_defaults(synth_model):
    """Qwen2.5's ChatML: its default system prompt, no thinking block pre-filled, whatever --no-think says."""
    from streamer.chat import QWEN2_SYSTEM, Conversation, thinks
    from streamer.generate import Generator
    from streamer.sampler import Sampler, SamplerParams

    s = open_model(synth_model("tiny-qwen2", "Q8_0"), StreamOptions(stream=False, learn=False))
    gen = Generator(s.model, s.model.new_state(), Sampler(SamplerParams()), s.tokenizer.eog_ids)
    for think in (True, False):
        conv = Conversation(gen, s.tokenizer, think=think, arch="qwen2")
        closing, body = conv._turn_parts("hi")
        assert closing == f"<|im_start|>system\n{QWEN2_SYSTEM}<|im_end|>\n"
        assert body == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not thinks("qwen2", True) and thinks("qwen3", True)
    qwen3 = Conversation(gen, s.tokenizer, think=False, arch="qwen3")
    assert qwen3._turn_parts("hi")[1].endswith("<think>\n\n</think>\n\n") and qwen3._turn_parts("hi")[0] == ""
