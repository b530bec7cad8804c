"""stream-run perplexity: llama-perplexity's windows and scoring, checked against an independent computation
(log-softmax of tests/reference.py's float64 logits over the same windows), streamed == resident to the last
digit, and the CLI's errors and --json."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from reference import Reference

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.options import StreamOptions
from streamer.perplexity import perplexity, plan
from streamer.session import open_model

N_CTX = 16


def reference_ppl(ref: Reference, tokens, n_ctx, n_chunk, bos_id=None, second_half=True):
    """exp(mean nll) over each window's second half, from float64 logits of the window run from position 0."""
    nll = []
    for i in range(n_chunk):
        w = np.array(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            w[0] = bos_id
        logits = ref.logits(w)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        first = n_ctx // 2 if second_half else 0
        for j in range(first, n_ctx - 1):
            nll.append(lse[j] - logits[j, w[j + 1]])
    return math.exp(np.mean(nll)), np.array(nll)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, 300, size=3 * N_CTX + 5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_perplexity_matches_float64_reference(synth_model, tokens, preset):
    path = synth_model(preset, "Q8_0")
    ref = Reference(str(path))
    with open_model(path, StreamOptions(stream=False, learn=False), n_ctx=N_CTX) as s:
        r = perplexity(s.model, tokens, N_CTX)
    assert r.n_chunk == 3 and r.count == 3 * (N_CTX - 1 - N_CTX // 2)
    want, nll = reference_ppl(ref, tokens, N_CTX, 3)
    assert r.ppl == pytest.approx(want, rel=2e-3)
    mean = nll.mean()
    assert r.stderr == pytest.approx(want * math.sqrt(((nll**2).mean() - mean**2) / (len(nll) - 1)), rel=2e-2)
    # the tolerance separates llama-perplexity's method from its near misses: scoring whole windows, or one
    # long sequence instead of windows restarted at position 0
    whole, _ = reference_ppl(ref, tokens, N_CTX, 3, second_half=False)
    assert abs(whole / want - 1) > 1e-2
    assert r.running[0] == pytest.approx(reference_ppl(ref, tokens, N_CTX, 1)[0], rel=2e-3)


def test_bos_replaces_each_windows_first_token(synth_model, tokens):
    path = synth_model("tiny", "Q8_0")
    with open_model(path, StreamOptions(stream=False, learn=False), n_ctx=N_CTX) as s:
        r = perplexity(s.model, tokens, N_CTX, chunks=2, bos_id=5)
        plain = perplexity(s.model, tokens, N_CTX, chunks=2)
    want, _ = reference_ppl(Reference(str(path)), tokens, N_CTX, 2, bos_id=5)
    assert r.ppl == pytest.approx(want, rel=2e-3) and r.ppl != plain.ppl


def test_streamed_quarter_cache_equals_resident_to_the_last_digit(synth_model, tokens):
    path = synth_model("tiny-moe", "Q8_0")
    with open_model(path, StreamOptions(stream=False, learn=False), n_ctx=N_CTX) as s:
        resident = perplexity(s.model, tokens, N_CTX)
        layout = ExpertLayout(s.gf, s.cfg)
    for prefetch in (False, True):
        cache = max(layout.total_bytes // 4, 4 * layout.slot_bytes)
        opts = StreamOptions(learn=False, prefetch=prefetch, expert_cache_bytes=cache)
        with open_model(path, opts, n_ctx=N_CTX) as s:
            assert s.streaming
            got = perplexity(s.model, tokens, N_CTX)
        assert (got.nll, got.nll2, got.running) == (resident.nll, resident.nll2, resident.running)


def test_plan_follows_llama_perplexity():
    assert plan(100, 16, None) == 6 and plan(100, 16, 2) == 2 and plan(32, 16, None) == 2
    for args in ((31, 16, None), (100, 3, None), (100, 16, 0)):
        with pytest.raises(StreamerError):
            plan(*args)


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "streamer.cli.main", "perplexity", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_json_and_errors(synth_model, tmp_path):
    path = synth_model("tiny-moe", "Q8_0")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 12)
    p = cli(path, "-f", text, "-c", N_CTX, "--chunks", 2, "--json", "-t", 1)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["chunks"] == 2 and out["tokens_scored"] == 2 * (N_CTX - 1 - N_CTX // 2) and out["ppl"] > 1
    assert out["running_ppl"][-1] == out["ppl"]
    plain = cli(path, "-f", text, "-c", N_CTX, "--chunks", 2, "-t", 1)
    assert plain.returncode == 0 and f"Final estimate: PPL = {out['ppl']:.4f} +/- " in plain.stdout
    assert "[1]" in plain.stdout and "[2]" in plain.stdout
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    for args, words in (
        ((path, "-f", short, "-c", N_CTX), "needs at least 32"),
        ((path, "-f", text, "-c", 2), "at least 4"),
        ((path, "-f", text, "-c", N_CTX, "--chunks", 0), "--chunks"),
        ((path, "-f", tmp_path / "missing.txt"), "missing.txt"),
        ((tmp_path / "nope.gguf", "-f", text), "nope.gguf"),
    ):
        p = cli(*args)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], p.stderr
        assert "compiling" not in p.stderr
