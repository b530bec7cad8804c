"""The added formats (Q2_K, Q3_K, IQ4_XS, IQ4_NL, Q4_1, Q5_0, Q5_1, MXFP4, IQ1-3_*) end to end: a tiny
MoE written in each, every matrix in that format (attention, experts, embedding, head), against the float64
reference over gguf-py's dequantizer, and streamed equal to resident bit for bit. The per-kernel checks on
random blocks with extreme scales are in test_kernels.py and test_kernels_experts.py."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from reference import Reference, cosines

from streamer.experts.store import ExpertLayout
from streamer.formats import FORMATS
from streamer.options import StreamOptions
from streamer.session import open_model

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], dtype=np.int64)
# every block format beyond the five the model tests already cover (the table in streamer/formats.py)
NEW = [t.name for t, f in FORMATS.items() if f.family == "block" and t not in (T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K)]


def run(session, n_prefill=5):
    c = session.model.new_state()
    out = [session.model.forward(PROMPT[:n_prefill], c, all_logits=True)]
    out += [session.model.forward(PROMPT[i : i + 1], c, all_logits=True) for i in range(n_prefill, len(PROMPT))]
    return np.concatenate(out)


@pytest.mark.parametrize("qtype", NEW)
def test_tiny_moe_matches_float64_reference_and_streams_identically(synth_model, qtype):
    path = synth_model("tiny-moe", qtype)
    s = open_model(path, StreamOptions(stream=False, learn=False))
    assert {t.qtype.name for t in s.gf.tensors.values()} == {qtype, "F32"}
    got = run(s)
    want = Reference(str(path)).logits(PROMPT)
    cos = cosines(got, want)
    assert cos.min() >= 0.999, cos.min()
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    slot = ExpertLayout(s.gf, s.cfg).slot_bytes
    streamed = open_model(path, StreamOptions(learn=False, expert_cache_bytes=6 * slot))
    assert streamed.streaming and np.array_equal(run(streamed), got)
    streamed.close()


@pytest.mark.parametrize("qtype", ["Q3_K", "IQ4_XS"])
def test_tiny_dense_matches_float64_reference(synth_model, qtype):
    path = synth_model("tiny", qtype)
    got = run(open_model(path, StreamOptions(stream=False, learn=False)))
    want = Reference(str(path)).logits(PROMPT)
    cos = cosines(got, want)
    assert cos.min() >= 0.999 and np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
