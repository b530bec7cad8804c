"""Batched decoding (Model.step, generate.step_together): several sequences, each at its own position with its own
state, step together; the FFN reads the union of their experts once. A sequence's logits match the float64
reference forward of that sequence alone, its greedy tokens are those it gets alone, streamed equals resident
bit for bit, and the traffic counts what the batch shared."""

from pathlib import Path

import numpy as np
import pytest
from reference import Reference, cosines

from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.generate import Generator, step_together
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.session import open_model

MODELS = Path(__file__).resolve().parents[1] / "streamer" / "models"
DENSE, MOE = MODELS / "stdlib-qwen3-q8_0.gguf", MODELS / "stdlib-qwen3moe-q8_0.gguf"
RESIDENT = StreamOptions(stream=False, learn=False)


def sequences(n_vocab: int, b: int, steps: int, seed: int = 5) -> list[np.ndarray]:
    """b token sequences of different prompt lengths (so the batch's positions differ), each with `steps` more."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=3 + 4 * i + steps) for i in range(b)]


def reference_steps(path, seqs: list[np.ndarray], steps: int) -> list[np.ndarray]:
    """Each sequence's float64 reference logits at its last `steps` positions (what batched computes)."""
    ref = Reference(str(path))
    return [ref.logits(ids)[len(ids) - steps :] for ids in seqs]


def batched(s, seqs: list[np.ndarray], steps: int) -> np.ndarray:
    """Prefill each sequence's prompt alone, then feed the last `steps` tokens of every sequence one batched step
    at a time: logits (steps, b, vocab), those of step j at each sequence's position len - steps + j."""
    states = [s.model.new_state() for _ in seqs]
    for st, ids in zip(states, seqs):
        s.model.forward(ids[: len(ids) - steps], st)
    out = []
    for j in range(steps):
        out.append(s.model.step([ids[len(ids) - steps + j] for ids in seqs], states))
    assert [st.n for st in states] == [len(ids) for ids in seqs]
    return np.stack(out)


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("b", [2, 4])  # 4 rows: the projections take the matrix-matrix kernels
def test_each_sequence_matches_its_own_float64_forward(path, b):
    steps = 6
    with open_model(path, RESIDENT, n_ctx=64) as s:
        seqs = sequences(s.cfg.n_vocab, b, steps)
        got = batched(s, seqs, steps)
        alone = []
        for ids in seqs:  # the same tokens, one sequence at a time (the one-token decode path)
            st = s.model.new_state()
            s.model.forward(ids[: len(ids) - steps], st)
            alone.append([s.model.forward(ids[i : i + 1], st) for i in range(len(ids) - steps, len(ids))])
    for i, want in enumerate(reference_steps(path, seqs, steps)):
        g = got[:, i]
        cos = cosines(g, want)
        assert cos.min() >= 0.9999, cos  # test_trained's bound for this model alone
        assert np.mean(g.argmax(1) == want.argmax(1)) >= 5 / 6
        # in the batch or alone: the same logits within the kernels' error (test_trained: 0.2% of the scale)
        a = np.array(alone[i])
        assert np.abs(g - a).max() <= 2e-3 * np.abs(a).max()
        assert np.array_equal(g.argmax(1), a.argmax(1))
        if b < 4:  # each row through its one-token blocks, the head by matvec as alone: the same bits
            assert np.array_equal(g, a)


def test_greedy_tokens_do_not_depend_on_the_batch():
    """Four requests generated together give each the tokens it generates alone (temperature 0)."""
    prompts = [[258, 381, 714], [710, 198], [527, 679, 554, 276, 11], [16, 277]]
    n = 20
    with open_model(MOE, RESIDENT, n_ctx=64) as s:

        def gen():
            return Generator(s.model, s.model.new_state(), Sampler(SamplerParams(temperature=0)))

        want = [list(gen().generate(p, n)) for p in prompts]
        gens = [gen() for _ in prompts]
        logits = np.stack([g.start(p) for g, p in zip(gens, prompts)])
        got = [[] for _ in prompts]
        for j in range(n):
            for b, g in enumerate(gens):
                got[b].append(g.pick(logits[b]))
            if j < n - 1:
                logits = step_together(gens)
        assert got == want
        assert [g.state.n for g in gens] == [len(p) + n - 1 for p in prompts]
        assert all(g.pending == w[-1] and g.history[-1] == w[-2] for g, w in zip(gens, want))
        assert gens[0].stats.gen_tokens == n - 1


@pytest.mark.parametrize("prefetch", [False, True])
def test_streamed_batch_equals_resident_bit_for_bit(prefetch):
    steps = 8
    with open_model(MOE, RESIDENT, n_ctx=64) as s:
        seqs = sequences(s.cfg.n_vocab, 3, steps, seed=11)
        resident = batched(s, seqs, steps)
        quarter = ExpertLayout(s.gf, s.cfg).total_bytes // 4
    opts = StreamOptions(learn=False, prefetch=prefetch, expert_cache_bytes=quarter)
    with open_model(MOE, opts, n_ctx=64) as s:
        assert s.streaming
        s.populate()
        s.traffic.reset()
        np.testing.assert_array_equal(batched(s, seqs, steps), resident)
        t = s.traffic.report()["totals"]
        assert t["miss"] > 0  # it really streamed
        # what the sequences shared in the batched steps: each layer call's uses beyond its distinct experts
        shared = t["routed"] - t["requests"]
        assert t["shared"] > 0 and t["shared"] <= shared
        if prefetch:
            assert t["recall_total"] > 0  # the lookahead predicted the batch's union


def test_hybrid_batch_matches_float64_reference(synth_model):
    """Recurrent (Gated DeltaNet) and gated-attention layers step each sequence on its own state."""
    path = synth_model("tiny-qwen35moe", "Q8_0")
    steps = 5
    with open_model(path, RESIDENT, n_ctx=64) as s:
        seqs = sequences(s.cfg.n_vocab, 3, steps, seed=2)
        got = batched(s, seqs, steps)
    for i, want in enumerate(reference_steps(path, seqs, steps)):
        cos = cosines(got[:, i], want)
        assert cos.min() >= 0.999, cos  # test_hybrid's bound past position 0


def test_bad_steps_are_refused_and_move_nothing():
    with open_model(DENSE, RESIDENT, n_ctx=8) as s:
        a, b = s.model.new_state(), s.model.new_state()
        s.model.forward([1, 2, 3], a)
        s.model.forward(list(range(1, 9)), b)  # b is full
        with pytest.raises(StreamerError, match="distinct sequences"):
            s.model.step([4, 5], [a, a])
        with pytest.raises(StreamerError, match="distinct sequences"):
            s.model.step([4], [a, b])
        with pytest.raises(StreamerError, match="context overflow"):
            s.model.step([4, 5], [a, b])
        with pytest.raises(StreamerError):
            s.model.step([4, s.cfg.n_vocab], [a, s.model.new_state()])
        assert (a.n, b.n) == (3, 8)


def test_bench_parallel_reports_the_batch_and_each_sequence_greedy(synth_model):
    """`bench --parallel 3`: every sequence's greedy tokens are those of its prompt decoded alone; the aggregate is
    the sequences' tokens over the decode's wall time; the experts per step are the batch's union (more than one
    token's k, at most k per token)."""
    import json

    from typer.testing import CliRunner

    from streamer.bench import prompt_tokens
    from streamer.cli.main import app

    path = synth_model("tiny-moe", "Q8_0")
    r = CliRunner().invoke(app, ["bench", str(path), "--pp", "5", "--tg", "6", "-np", "3", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["parallel"] == 3 and len(d["tokens_per_sequence"]) == 3
    assert d["aggregate_tg_tok_s"] == pytest.approx(3 * d["tg_tok_s"])
    with open_model(path, RESIDENT, n_ctx=16) as s:
        k = s.cfg.n_expert_used
        for seq, got in enumerate(d["tokens_per_sequence"]):
            ids = prompt_tokens(s.cfg.n_vocab, 5, seed=1234 + seq)
            st = s.model.new_state()
            want = [int(np.argmax(s.model.forward(ids, st)))]
            for _ in range(5):
                want.append(int(np.argmax(s.model.forward([want[-1]], st))))
            assert got == want
    assert k < d["experts_per_step"] <= 3 * k
    assert d["shared_bytes_per_token"] >= 0
    text = CliRunner().invoke(app, ["bench", str(path), "--pp", "4", "--tg", "3", "-np", "2"])
    assert text.exit_code == 0 and "x 2 sequences" in text.stdout and "per sequence" in text.stdout, text.output


@pytest.mark.parametrize("cmd", ["bench", "serve"])
def test_parallel_below_one_is_one_line_and_exit_2(synth_model, cmd):
    from typer.testing import CliRunner

    from streamer.cli.main import app

    r = CliRunner().invoke(app, [cmd, str(synth_model("tiny-moe", "Q8_0")), "--parallel", "0"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1] == "error: --parallel must be at least 1, got 0"
    assert "Traceback" not in r.output


def many(s, seqs: list[np.ndarray], cut: list[int]) -> np.ndarray:
    """Prefill seqs[b][:cut[b]] alone, then the rest of every sequence in one forward_many: each one's logits."""
    states = [s.model.new_state() for _ in seqs]
    for st, ids, c in zip(states, seqs, cut):
        if c:
            s.model.forward(ids[:c], st)
    out = s.model.forward_many([ids[c:] for ids, c in zip(seqs, cut)], states)
    assert [st.n for st in states] == [len(ids) for ids in seqs]
    return out


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_prompts_together_match_their_own_float64_forward(path):
    """Chunks of different lengths (one of a single token) from different positions, in one forward."""
    rng = np.random.default_rng(8)
    with open_model(path, RESIDENT, n_ctx=64) as s:
        seqs = [rng.integers(0, s.cfg.n_vocab, size=n) for n in (12, 7, 20)]
        cut = [0, 6, 9]  # the second sequence adds one token, the others 12 and 11
        got = many(s, seqs, cut)
        alone = [s.model.forward(ids, s.model.new_state()) for ids in seqs]
    ref = Reference(str(path))
    for i, ids in enumerate(seqs):
        want = ref.logits(ids)[-1]
        g = got[i]
        assert np.dot(g, want) / np.linalg.norm(g) / np.linalg.norm(want) >= 0.9999
        assert np.abs(g - alone[i]).max() <= 2e-3 * np.abs(alone[i]).max()
        assert g.argmax() == alone[i].argmax()


def test_streamed_prompts_together_equal_resident_bit_for_bit():
    rng = np.random.default_rng(9)
    seqs = [rng.integers(0, 400, size=n) for n in (10, 16, 5)]
    cut = [0, 4, 2]
    with open_model(MOE, RESIDENT, n_ctx=64) as s:
        resident = many(s, seqs, cut)
        quarter = ExpertLayout(s.gf, s.cfg).total_bytes // 4
    with open_model(MOE, StreamOptions(learn=False, expert_cache_bytes=quarter), n_ctx=64) as s:
        np.testing.assert_array_equal(many(s, seqs, cut), resident)
        assert s.traffic.report()["totals"]["miss"] > 0


def test_hybrid_prompts_together_match_float64_reference(synth_model):
    path = synth_model("tiny-qwen35moe", "Q8_0")
    rng = np.random.default_rng(3)
    with open_model(path, RESIDENT, n_ctx=64) as s:
        seqs = [rng.integers(0, s.cfg.n_vocab, size=n) for n in (9, 14)]
        got = many(s, seqs, [3, 5])
    ref = Reference(str(path))
    for g, ids in zip(got, seqs):
        want = ref.logits(ids)[-1]
        assert np.dot(g, want) / np.linalg.norm(g) / np.linalg.norm(want) >= 0.999


def test_bad_forwards_of_several_sequences_are_refused():
    with open_model(DENSE, RESIDENT, n_ctx=64) as s:
        a, b = s.model.new_state(), s.model.new_state()
        with pytest.raises(StreamerError, match="empty"):
            s.model.forward_many([[1, 2], []], [a, b])
        s.model.ubatch = 8
        with pytest.raises(StreamerError, match="more than the chunk size 8"):
            s.model.forward_many([list(range(1, 6)), list(range(1, 6))], [a, b])
        assert (a.n, b.n) == (0, 0)


def test_float_attention_batches_its_projections_and_matches_float64(synth_model):
    """Float weights have no one-call blocks: the step's attention is Attention.step (projections of all rows
    together, each row over its own K/V)."""
    path = synth_model("tiny", "F16")
    steps = 4
    with open_model(path, RESIDENT, n_ctx=64) as s:
        assert not s.model.decodes_in_blocks
        seqs = sequences(s.cfg.n_vocab, 4, steps, seed=4)
        got = batched(s, seqs, steps)
    for i, want in enumerate(reference_steps(path, seqs, steps)):
        cos = cosines(got[:, i], want)
        assert cos.min() >= 0.9999, cos
