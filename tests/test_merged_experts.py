"""Experts whose gate and up are one tensor (`ffn_gate_up_exps`: each expert's gate rows, then its up rows, as
llama.cpp's converter writes them with --fuse-gate-up-exps): the same weights as two tensors give the same logits
bit for bit, in place and streamed through a small cache, and the float64 reference (gguf-py's dequantizer on the
merged tensor) agrees."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from reference import Reference, cosines

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.gguf_file import GGUFFile
from streamer.options import StreamOptions
from streamer.session import open_model

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64, 300, 7, 7, 180], dtype=np.int64)


def run(s, n_prefill=6):
    """Prefill n_prefill tokens, then one at a time (decode): all-position logits."""
    st = s.model.new_state()
    out = [s.model.forward(PROMPT[:n_prefill], st, all_logits=True)]
    out += [s.model.forward(PROMPT[i : i + 1], st, all_logits=True) for i in range(n_prefill, len(PROMPT))]
    return np.concatenate(out)


@pytest.mark.parametrize(
    "preset, qtype, recipe",
    [
        ("tiny-moe", "Q8_0", None),  # the multi-expert kernels (their byte offsets step over the other half)
        ("tiny-moe", "BF16", None),  # one QMatrix per expert (a view of its half of the slab)
        ("tiny-qwen35moe", "Q8_0", "Q4_K_M"),  # a hybrid, llama-quantize's mix (down Q6_K on some layers)
    ],
)
def test_merged_gate_up_equals_the_two_tensors(synth_model, preset, qtype, recipe):
    two = synth_model(preset, qtype, recipe=recipe)
    one = synth_model(preset, qtype, recipe=recipe, fuse_gate_up_exps=True)
    names = GGUFFile(one).tensors
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    want = run(open_model(two, StreamOptions(stream=False, learn=False)))
    resident = open_model(one, StreamOptions(stream=False, learn=False))
    np.testing.assert_array_equal(run(resident), want)
    slot = ExpertLayout(resident.gf, resident.cfg).slot_bytes
    streamed = open_model(one, StreamOptions(learn=False, expert_cache_bytes=5 * slot))
    assert streamed.moe.source.streams
    np.testing.assert_array_equal(run(streamed), want)


def test_merged_gate_up_matches_the_float64_reference(synth_model):
    path = synth_model("tiny-moe", "Q8_0", fuse_gate_up_exps=True)
    got = run(open_model(path, StreamOptions(stream=False, learn=False)))
    want = Reference(str(path)).logits(PROMPT)
    cos = cosines(got, want)
    assert cos.min() >= 0.999, cos
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.98


def test_synth_refuses_to_fuse_a_dense_preset(tmp_path):
    from typer.testing import CliRunner

    from streamer.cli.main import app

    r = CliRunner().invoke(app, ["synth", str(tmp_path / "x.gguf"), "--preset", "tiny", "--fuse-gate-up-exps"])
    assert r.exit_code == 2 and "has no experts" in r.output
    with pytest.raises(StreamerError, match="types differ"):
        from streamer.synth.writer import _fuse_gate_up

        _fuse_gate_up(
            [
                ("blk.0.ffn_gate_exps.weight", (4, 8, 32), T.Q8_0, 1.0),
                ("blk.0.ffn_up_exps.weight", (4, 8, 32), T.Q4_K, 1.0),
            ]
        )
