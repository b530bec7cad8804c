"""stream-run against llama.cpp's own logits (tests/golden/llama_logits.npz, written by bench/llama_golden.py).

llama.cpp is never run here: the golden file holds its per-position logits under teacher forcing for tiny
synthetic models, and the writer arguments and sha256 of each model. The test rebuilds each model with the
project's writer, checks it is byte-identical to the one llama.cpp saw, runs stream-run's all-positions
forward, and compares position by position.

What the comparison proves: that stream-run reads the GGUF the way llama.cpp does (tensor layouts, RoPE
pairing, head grouping, norms, tied head, MoE routing). The float64 reference (tests/test_model.py) is the
tight numeric check; llama.cpp is not exact math itself, so the bounds below are about llama.cpp's error.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "llama_logits.npz"
REGENERATE = "regenerate with: python bench/llama_golden.py (needs llama-cpp-python, see bench/)"


# Tolerances, with the measurements behind them (llama-cpp-python 0.3.36, 2 threads, 32 positions, measured
# on two versions of the byte vocabulary (343 and 381 tokens, i.e. two different sets of random weights).
# stream-run's dense path equals the float64 reference to cosine 1.000000, so the numbers below are
# llama.cpp's own deviation from exact math: it quantizes activations to q8_0 (Q8_0 weights) or q8_K
# (K-quant weights) before every matmul and keeps K/V in f16. That costs ~1e-4 in cosine; a wrong tensor
# layout, RoPE pairing or head mapping costs far more (another seed gives cosine ~0; a 2% scale error trips
# the norm check).
#   dense Q8_0:      min cosine 0.99990-0.99992, |norm ratio - 1| <= 0.0022
#   dense Q4_K:      min cosine 0.99966-0.99981, |norm ratio - 1| <= 0.0024
#   dense Q6_K tied: min cosine 0.99980-0.99982, |norm ratio - 1| <= 0.0022
#   MoE: where router scores are near-tied, llama.cpp (whose router input carries the rounding above) picks
#   another expert set, which moves that position's logits: tiny-moe Q8_0 min cosine 0.9945 / 0.9992
#   (median 0.9998+), tiny-moe Q4_K 0.9983 (median 0.9997, >= 94% of positions >= 0.999), norm <= 0.0054.
#   A bigger random Q4_K MoE measured ~0.96 (more layers, more near-ties), so min_cos is not tighter than 0.98.
# Top-1: llama.cpp's per-logit error reaches 0.05-0.07 x std(logits) dense (0.2-0.37 at a MoE routing
# flip), so argmaxes may differ where the top two are that close. Measured: top-1 agreement 0.94-1.0 dense
# (flips had gaps <= 0.041 std), 0.91-1.0 MoE (gaps <= 0.08 std). The check: agreement >= `top1`, and at
# every disagreement each side's logit for the other's pick is within `tie` x std of its own maximum, i.e.
# a flip must be a near-tie (`tie` is ~2x the per-logit error above).
TOL = {
    "dense_q8": dict(min_cos=0.9995, frac_cos_0999=1.0, norm=0.01, top1=0.85, tie=0.15),
    "dense_k": dict(min_cos=0.999, frac_cos_0999=1.0, norm=0.01, top1=0.85, tie=0.15),
    "moe": dict(min_cos=0.98, frac_cos_0999=0.8, norm=0.03, top1=0.8, tie=0.3),
}


def _tol_for(args: dict) -> dict:
    if args["preset"].endswith("moe"):
        return TOL["moe"]
    return TOL["dense_q8"] if args["qtype"] == "Q8_0" else TOL["dense_k"]


def _load_golden():
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing; {REGENERATE}")
    z = np.load(GOLDEN)
    meta = json.loads(str(z["meta_json"]))
    return z, meta


_Z, _META = _load_golden()
MODEL_NAMES = sorted(_META["models"])
MOE_NAMES = [n for n in MODEL_NAMES if _META["models"][n]["writer_args"]["preset"].endswith("moe")]


def _sha256(path: Path, start: int = 0) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write(path: Path, writer_args: dict) -> Path:
    from streamer.synth.writer import spec_for, write_model

    a = dict(writer_args)
    write_model(path, spec_for(a.pop("preset"), a.pop("qtype"), a.pop("layers", None), **a))
    return path


def _check_same_file(path: Path, name: str, rec: dict) -> None:
    got = _sha256(path)
    if got == rec["sha256"]:
        return
    import gguf

    same_tensors = _sha256(path, int(gguf.GGUFReader(path).data_offset)) == rec["tensor_data_sha256"]
    what = (
        "the tensor data is identical, only the header/metadata changed (e.g. the byte vocabulary)"
        if same_tensors
        else "the tensor data differs too"
    )
    pytest.fail(
        f"{name}: the synthetic writer's output changed since the golden logits were made "
        f"(sha256 {got[:12]} != recorded {rec['sha256'][:12]}; {what}); the golden data no longer "
        f"describes this file: {REGENERATE}"
    )


def _cosines(a, b):
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def compare(ours: np.ndarray, theirs: np.ndarray, tol: dict) -> tuple[list[str], dict]:
    """Per-position agreement of two (n_tokens, vocab) logit arrays; returns (failures, stats)."""
    cos = _cosines(ours.astype(np.float64), theirs.astype(np.float64))
    norm = np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    a, b = ours.argmax(1), theirs.argmax(1)
    rows = np.arange(len(a))
    std = float(theirs.std())
    gap_ours = (ours[rows, a] - ours[rows, b]) / std  # how far our pick is ahead of llama's pick, in our logits
    gap_theirs = (theirs[rows, b] - theirs[rows, a]) / std
    flips = a != b
    stats = dict(
        min_cos=float(cos.min()),
        median_cos=float(np.median(cos)),
        frac_cos_0999=float((cos >= 0.999).mean()),
        max_norm_dev=float(np.abs(norm - 1).max()),
        top1=float(1 - flips.mean()),
        max_flip_gap=float(max(gap_ours[flips].max(initial=0), gap_theirs[flips].max(initial=0))),
    )
    bad = []
    if stats["min_cos"] < tol["min_cos"]:
        bad.append(f"min cosine {stats['min_cos']:.6f} < {tol['min_cos']} at position {int(cos.argmin())}")
    if stats["frac_cos_0999"] < tol["frac_cos_0999"]:
        bad.append(
            f"only {stats['frac_cos_0999']:.0%} of positions have cosine >= 0.999 (want {tol['frac_cos_0999']:.0%})"
        )
    if stats["max_norm_dev"] > tol["norm"]:
        bad.append(
            f"logit norm differs by {stats['max_norm_dev']:.4f} (> {tol['norm']}) at position "
            f"{int(np.abs(norm - 1).argmax())}: a scale error"
        )
    if stats["top1"] < tol["top1"]:
        bad.append(f"top-1 agreement {stats['top1']:.2f} < {tol['top1']}")
    if stats["max_flip_gap"] > tol["tie"]:
        bad.append(
            f"a top-1 disagreement is not a near-tie: gap {stats['max_flip_gap']:.3f} std > {tol['tie']} "
            f"(positions {np.nonzero(flips)[0].tolist()})"
        )
    return bad, stats


def test_golden_file_is_small_and_consistent():
    assert GOLDEN.stat().st_size < 1_000_000
    tokens = _Z["tokens"]
    assert tokens.tolist() == _META["tokens"]
    for name, rec in _META["models"].items():
        assert _Z[f"{name}.logits"].shape == (len(tokens), rec["n_vocab"])


def _small_expert_cache(path: Path) -> int:
    """Bytes for ~8 expert slots (gate+up+down of one expert each, with O_DIRECT alignment slack): far fewer
    than the model's n_layer x n_expert, so the streamed path really evicts and re-reads."""
    import gguf

    r = gguf.GGUFReader(path)
    n_expert = int(r.fields["qwen3moe.expert_count"].parts[-1][0])
    part = {t.name.split(".")[2]: int(t.n_bytes) // n_expert for t in r.tensors if t.name.startswith("blk.0.ffn_")}
    slot = sum(part[k] + 2 * 4096 for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    return 8 * slot


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_logits_match_llama_cpp(name, tmp_path_factory):
    _run_and_compare(name, tmp_path_factory, streamed=False)


@pytest.mark.parametrize("name", MOE_NAMES)
def test_streamed_moe_logits_match_llama_cpp(name, tmp_path_factory):
    """The same comparison with experts read from disk through a small cache instead of used in place."""
    _run_and_compare(name, tmp_path_factory, streamed=True)


def _run_and_compare(name, tmp_path_factory, streamed: bool):
    rec = _META["models"][name]
    args = rec["writer_args"]
    if args["preset"].endswith("moe"):
        pytest.importorskip("streamer.moe", reason="MoE (streamer.moe) is not built yet")
    from streamer.options import StreamOptions
    from streamer.session import open_model

    path = _write(tmp_path_factory.mktemp("golden") / f"{name}.gguf", args)
    _check_same_file(path, name, rec)
    s = (
        open_model(path, StreamOptions(expert_cache_bytes=_small_expert_cache(path), learn=False))
        if streamed
        else open_model(path)
    )
    tokens = np.asarray(_META["tokens"], np.int64)
    ours = np.asarray(s.model.forward(tokens, s.model.new_state(), all_logits=True), np.float32)
    theirs = _Z[f"{name}.logits"]
    assert ours.shape == theirs.shape
    bad, stats = compare(ours, theirs, _tol_for(args))
    assert not bad, f"{name} vs llama.cpp {_META['llama']['versions']}: " + "; ".join(bad) + f" | {stats}"


# The golden models' forward in a process whose activations are one int8 digit (ggml's grid: AVX2's default;
# this process runs two, conftest.py), and for the MoE models again streamed through a small expert cache
# (argv: a JSON {name: cache bytes})
_ONE_DIGIT = """
import json, sys
import numpy as np
from streamer.kernels import int8
from streamer.options import StreamOptions
from streamer.session import open_model
assert int8.DIGITS == 1, int8.DIGITS
d, tokens, streamed = sys.argv[1], np.asarray(json.loads(sys.argv[2]), np.int64), json.loads(sys.argv[3])
def logits(s):
    return np.asarray(s.model.forward(tokens, s.model.new_state(), all_logits=True), np.float32)
out = {}
for name in sys.argv[4:]:
    out[name] = logits(open_model(f"{d}/{name}.gguf"))
    if name in streamed:
        opts = StreamOptions(expert_cache_bytes=streamed[name], learn=False)
        out[name + ".streamed"] = logits(open_model(f"{d}/{name}.gguf", opts))
np.savez(f"{d}/logits.npz", **out)
"""


@pytest.fixture(scope="module")
def one_digit_logits(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden-one-digit")
    for name, rec in _META["models"].items():
        _check_same_file(_write(d / f"{name}.gguf", rec["writer_args"]), name, rec)
    streamed = {name: _small_expert_cache(d / f"{name}.gguf") for name in MOE_NAMES}
    env = dict(os.environ, STREAM_RUN_ACT="int8")
    argv = [sys.executable, "-c", _ONE_DIGIT, str(d), json.dumps(_META["tokens"]), json.dumps(streamed), *MODEL_NAMES]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return np.load(d / "logits.npz")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_one_digit_logits_match_llama_cpp(name, one_digit_logits):
    """Activations as one int8 digit per element (STREAM_RUN_ACT=int8, AVX2's default) meet the same bounds
    against llama.cpp's logits as the default two digits."""
    ours, theirs = one_digit_logits[name], _Z[f"{name}.logits"]
    assert ours.shape == theirs.shape
    bad, stats = compare(ours, theirs, _tol_for(_META["models"][name]["writer_args"]))
    assert not bad, f"{name}, one digit, vs llama.cpp: " + "; ".join(bad) + f" | {stats}"


@pytest.mark.parametrize("name", MOE_NAMES)
def test_one_digit_streamed_equals_resident(name, one_digit_logits):
    np.testing.assert_array_equal(one_digit_logits[name + ".streamed"], one_digit_logits[name])
