"""Chat conversations against a full context: the oldest whole turns are dropped (system prompt kept) and
what is kept is re-read exactly, so every turn gets an answer; a turn that cannot fit is refused without
losing the conversation."""

import numpy as np
import pytest

from streamer.chat import Conversation
from streamer.errors import StreamerError
from streamer.generate import Generator
from streamer.options import StreamOptions
from streamer.sampler import Sampler, SamplerParams
from streamer.session import open_model


@pytest.fixture(scope="module")
def session(synth_model):
    return open_model(synth_model("tiny", "Q8_0"), StreamOptions(learn=False), n_ctx=512)


def conversation(session, n_predict=24, system="be brief"):
    gen = Generator(session.model, session.model.new_state(), Sampler(SamplerParams()), session.tokenizer.eog_ids)
    return Conversation(gen, session.tokenizer, system=system, think=False, n_predict=n_predict)


def test_full_context_drops_oldest_turns_and_keeps_the_system_prompt(session, capsys):
    conv, tok = conversation(session), session.tokenizer
    system_ids = tok.encode_raw("<|im_start|>system\nbe brief<|im_end|>\n")
    for i in range(12):
        before = list(conv.gen.history) + ([conv.gen.pending] if conv.gen.pending is not None else [])
        "".join(conv.send(f"question number {i}, please answer"))
        hist = conv.gen.history
        assert conv.gen.state.n == len(hist) <= conv.gen.state.n_ctx
        assert hist[: len(system_ids)] == system_ids  # the system prompt is never dropped
        if hist[: len(before)] != before:  # a shift happened: what follows the system prompt is a suffix of
            starts = conv._turn_starts()  # the old conversation, starting at a user turn
            kept_turns = hist[starts[0] :]
            old = before[len(system_ids) :]
            assert any(old[j : j + 5] == kept_turns[:5] for j in range(len(old))) or len(starts) == 1
    err = capsys.readouterr().err
    assert "context full: dropped the oldest" in err
    assert tok.decode(conv.gen.history).count("question number 11") == 1
    assert len(conv._turn_starts()) >= 2  # a shift keeps the recent turns, not just the system prompt


def test_kept_tokens_are_reread_exactly(session):
    """After shifts, the cache holds exactly the kept tokens at positions 0..n-1: the next logits agree with a
    fresh prefill of the history (to float32 rounding: prefill and decode kernels round differently)."""
    conv = conversation(session)
    for i in range(12):
        "".join(conv.send(f"tell me about {i}"))
    hist = list(conv.gen.history)
    fresh = session.model.new_state()
    session.model.forward(np.asarray(hist[:-1]), fresh)
    want = session.model.forward(np.asarray(hist[-1:]), fresh)
    cache = conv.gen.state
    cache.truncate(len(hist) - 1)
    got = session.model.forward(np.asarray(hist[-1:]), cache)
    assert np.dot(got, want) / np.linalg.norm(got) / np.linalg.norm(want) > 0.99999
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_a_turn_longer_than_the_context_is_refused_and_the_conversation_survives(session):
    conv = conversation(session)
    "".join(conv.send("hello"))
    hist = list(conv.gen.history)
    with pytest.raises(StreamerError, match="does not fit in the context size 512"):
        "".join(conv.send("word " * 600))
    assert conv.gen.history == hist and conv.gen.state.n == len(hist)
