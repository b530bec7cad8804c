"""ChatML conversations for Qwen3 that keep their KV cache between turns: each turn prefills only its own
tokens. Thinking is on by default; think=False pre-fills an empty <think></think> block as Qwen3's template
does for enable_thinking=False. The thinking of earlier turns stays in the cache (Qwen3's template would
drop it when re-rendering the history; keeping it is what makes "prefill only the new turn" possible)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from streamer.errors import StreamerError
from streamer.generate import Generator, Stats
from streamer.sampler import SamplerParams

logger = logging.getLogger(__name__)

# Qwen3's recommended sampling for chat (model card): thinking / non-thinking.
THINK_DEFAULTS = dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)
NO_THINK_DEFAULTS = dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0)
EMPTY_THINK = "<think>\n\n</think>\n\n"
# Qwen2.5's template: no thinking blocks, and this system prompt when none is given; its sampling defaults
# (generation_config: temperature 0.7, top-k 20, top-p 0.8) are Qwen3's non-thinking ones.
QWEN2_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def thinks(arch: str, think: bool) -> bool:
    """Whether replies open with a thinking block: Qwen3 unless --no-think; never Qwen2."""
    return think and arch != "qwen2"


def chat_defaults(think: bool) -> dict:
    return dict(THINK_DEFAULTS if think else NO_THINK_DEFAULTS)


def is_chatml(template: str | None) -> bool:
    return bool(template) and "<|im_start|>" in template


class Conversation:
    def __init__(
        self,
        gen: Generator,
        tokenizer,
        system: str | None = None,
        think: bool = True,
        n_predict: int = -1,
        arch: str = "qwen3",
    ):
        if not is_chatml(tokenizer.chat_template):
            logger.warning("the model's chat template is not ChatML; using ChatML anyway")
        self.gen, self.tok = gen, tokenizer
        self.qwen2 = arch == "qwen2"
        if self.qwen2 and system is None:
            system = QWEN2_SYSTEM
        self.system, self.think, self.n_predict = system, thinks(arch, think), n_predict
        self.im_end = tokenizer.token_id("<|im_end|>")
        self.user_marker = tokenizer.encode_raw("<|im_start|>user\n")

    def _turn_parts(self, user: str) -> tuple[str, str]:
        """(what closes the previous reply, or the system block on the first turn; the user turn itself)."""
        closing = ""
        if not self.gen.history and self.gen.pending is None:  # nothing in the cache yet: the first turn
            if self.system:
                closing = f"<|im_start|>system\n{self.system}<|im_end|>\n"
        elif self.gen.pending == self.im_end:
            closing = "\n"  # the reply ended with <|im_end|>, which is pending: it is fed with this turn
        else:
            closing = "<|im_end|>\n"  # the reply was cut short (-n, Ctrl-C, full context): close it
        body = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        return closing, body if self.think or self.qwen2 else body + EMPTY_THINK

    def reset(self) -> None:
        self.gen.reset()

    def _turn_starts(self) -> list[int]:
        """Where each user turn ('<|im_start|>user\\n') begins in the token history."""
        h, m = self.gen.history, self.user_marker
        return [i for i in range(len(h) - len(m) + 1) if h[i] == m[0] and h[i : i + len(m)] == m]

    def _prompt(self, user: str) -> list[int]:
        """The tokens to prefill for this turn. When they and room for the reply do not fit after what the
        cache holds, the oldest whole turns are dropped (the system prompt stays) until the context is at most
        half full, and what is kept is prefilled again: llama.cpp's context shift, done exactly (K is stored
        after RoPE, so shifting positions in place would need a re-rotation; re-reading is exact). Ctrl-C
        during that re-read leaves an empty conversation (the old cache is already overwritten)."""
        closing, body = (self.tok.encode_raw(t) for t in self._turn_parts(user))
        gen, n_ctx = self.gen, self.gen.state.n_ctx
        pend = [gen.pending] if gen.pending is not None else []
        reserve = self.n_predict if self.n_predict > 0 else n_ctx // 4
        if gen.state.n + len(pend) + len(closing) + len(body) + reserve <= n_ctx:
            return closing + body
        starts = self._turn_starts()
        if not starts:
            return closing + body  # nothing to drop: the turn alone is too long (forward says so)
        head, hist = gen.history[: starts[0]], gen.history
        n_drop, kept = len(starts), head  # every earlier turn, with the reply that closing and pending end
        for k in range(1, len(starts)):
            if len(head) + len(hist) - starts[k] + len(pend) + len(closing) + len(body) <= n_ctx // 2:
                n_drop, kept = k, head + hist[starts[k] :] + pend + closing
                break
        if len(kept) + len(body) > n_ctx:  # refuse before touching the cache: the conversation survives
            raise StreamerError(
                f"context overflow: this turn ({len(body)} tokens) does not fit in the context "
                f"size {n_ctx} (raise it with -c/--ctx-size)"
            )
        logger.info(f"(context full: dropped the oldest {n_drop} turn(s); re-reading the {len(kept)} tokens kept)")
        gen.reset()
        return kept + body

    def send(self, user: str) -> Iterator[str]:
        """Stream the assistant's reply as text pieces (never a broken UTF-8 character). The conversation is
        the KV cache's content: a turn interrupted during its prefill leaves no trace (Generator rolls back),
        one interrupted while replying keeps the reply so far."""
        ids = self._prompt(user)
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
