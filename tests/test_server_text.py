"""The server's text pieces, fed in every possible split: stop strings end the text at their first occurrence
and nothing after (or of) them is ever emitted; a leading <think> block becomes reasoning, the rest content.
The oracles are the obvious whole-string computations (str.find, a regex)."""

import itertools
import re

import pytest

from streamer.chat import EMPTY_THINK
from streamer.server.text import StopMatcher, ThinkSplitter, render_chat, thinking


def splits(text, max_cuts=2):
    """text cut into pieces at every combination of up to max_cuts positions."""
    for k in range(max_cuts + 1):
        for cuts in itertools.combinations(range(1, len(text)), k):
            bounds = (0, *cuts, len(text))
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stop_oracle(text, stops):
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize(
    "text,stops",
    [
        ("hello world, stop here please", ["stop"]),
        ("abcabcabd", ["abd"]),  # the held prefix "ab" repeats before the real match
        ("aaaab", ["aab", "b"]),  # two stops: the earliest occurrence wins
        ("no match at all", ["xyz", "lll"]),
        ("ends with a partial sto", ["stop"]),  # a held tail that never completes is emitted at the end
        ("你好世界你好", ["世界"]),
        ("x", []),
    ],
)
def test_stop_strings_in_every_split(text, stops):
    want = stop_oracle(text, stops)
    for pieces in splits(text):
        m, got, emitted_before_stop = StopMatcher(stops), [], []
        for p in pieces:
            got.append(m.push(p))
            emitted_before_stop.append("".join(got))
        got.append(m.flush())
        assert ("".join(got), m.stopped) == want, pieces
        for so_far in emitted_before_stop:  # never emitted anything the final answer takes back
            assert want[0].startswith(so_far)


def think_oracle(text):
    m = re.match(r"\s*<think>\n*(.*?)\n*</think>\n*(.*)\Z", text, re.S)
    if m:
        return m.group(1), m.group(2)
    m = re.match(r"\s*<think>\n*(.*?)\n*\Z", text, re.S)  # never closed: all reasoning
    return (m.group(1), "") if m else ("", text)


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nI should greet.\n</think>\n\nHello there!",
        "<think>\n\n</think>\n\nanswer only",
        "\n<think>a</think>b",
        "plain answer with <think> inside",
        "<think>\nunfinished thought",
        "<thi",
        "",
    ],
)
def test_think_block_split_in_every_split(text):
    want = think_oracle(text)
    for pieces in splits(text):
        t, r, c = ThinkSplitter(), [], []
        for p in pieces:
            a, b = t.push(p)
            r.append(a)
            c.append(b)
        a, b = t.flush()
        assert ("".join(r) + a, "".join(c) + b) == want, pieces


def test_think_splitter_off_passes_everything_as_content():
    t = ThinkSplitter(enabled=False)
    assert t.push("<think>x</think>y") == ("", "<think>x</think>y")


def test_render_is_chat_commands_chatml():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again /no_think"},
    ]
    assert render_chat(msgs, think=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain /no_think<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # an earlier reply of ours comes back as we generated it (think block kept)
    assert "assistant\n<think>\nhm\n</think>\n\nhello<|im_end|>" in render_chat(
        msgs, think=True, replies={"hello": "<think>\nhm\n</think>\n\nhello"}
    )


@pytest.mark.parametrize(
    "texts,enable,want",
    [
        (["hi"], None, True),
        (["hi /no_think"], None, False),
        (["hi /no_think", "now /think"], None, True),  # the most recent switch wins
        (["/no_think please", "and again"], None, False),
        (["hi"], False, False),  # chat_template_kwargs.enable_thinking wins
        (["hi /no_think"], True, True),
    ],
)
def test_thinking_switch(texts, enable, want):
    msgs = [{"role": "user", "content": t} for t in texts]
    assert thinking(msgs, enable) is want
    assert render_chat(msgs, want).endswith("assistant\n" if want else EMPTY_THINK)
