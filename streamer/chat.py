"""ChatML conversations for Qwen3 that keep their KV cache between turns: each turn prefills only its own
tokens. Thinking is on by default; think=False pre-fills an empty <think></think> block as Qwen3's template
does for enable_thinking=False. The thinking of earlier turns stays in the cache (Qwen3's template would
drop it when re-rendering the history; keeping it is what makes "prefill only the new turn" possible)."""

from __future__ import annotations

import sys
from typing import Iterator

from streamer.generate import Generator, Stats
from streamer.sampler import SamplerParams

# Qwen3's recommended sampling for chat (model card): thinking / non-thinking.
THINK_DEFAULTS = dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)
NO_THINK_DEFAULTS = dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def chat_defaults(think: bool) -> dict:
    return dict(THINK_DEFAULTS if think else NO_THINK_DEFAULTS)


def is_chatml(template: str | None) -> bool:
    return bool(template) and "<|im_start|>" in template


class Conversation:
    def __init__(self, gen: Generator, tokenizer, system: str | None = None, think: bool = True,
                 n_predict: int = -1):
        if not is_chatml(tokenizer.chat_template):
            print("warning: the model's chat template is not ChatML; using ChatML anyway", file=sys.stderr)
        self.gen, self.tok = gen, tokenizer
        self.system, self.think, self.n_predict = system, think, n_predict
        self.im_end = tokenizer.token_id("<|im_end|>")

    def turn_text(self, user: str) -> str:
        """The ChatML text of one user turn, including the close of the previous assistant reply."""
        text = ""
        if not self.gen.history and self.gen.pending is None:  # nothing in the cache yet: the first turn
            if self.system:
                text += f"<|im_start|>system\n{self.system}<|im_end|>\n"
        elif self.gen.pending == self.im_end:
            text += "\n"  # the reply ended with <|im_end|>, which is pending: it is fed with this turn
        else:
            text += "<|im_end|>\n"  # the reply was cut short (-n, Ctrl-C): close it
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        return text if self.think else text + EMPTY_THINK

    def reset(self) -> None:
        self.gen.reset()

    def send(self, user: str) -> Iterator[str]:
        """Stream the assistant's reply as text pieces (never a broken UTF-8 character). The conversation is
        the KV cache's content: a turn interrupted during its prefill leaves no trace (Generator rolls back),
        one interrupted while replying keeps the reply so far."""
        ids = self.tok.encode_raw(self.turn_text(user))
        self.gen.stats = Stats()  # per-turn figures
        dec = self.tok.stream_decoder()
        for t in self.gen.generate(ids, self.n_predict):
            piece = dec.push(t)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail


def sampler_params(think: bool, **overrides) -> SamplerParams:
    """Chat sampling: Qwen3's recommendations unless the user set a value (None = not set)."""
    p = chat_defaults(think)
    p.update({k: v for k, v in overrides.items() if v is not None})
    return SamplerParams(**p)
