"""The prefill/decode loop. It yields tokens as they are sampled; the CLI and chat only consume it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from streamer.sampler import Sampler
from streamer.state import SequenceState

if TYPE_CHECKING:
    from streamer.model import Model


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0

    def line(self) -> str:
        pr = self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0
        gr = self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0
        return (
            f"prompt: {self.prompt_tokens} tok in {self.prompt_s:.2f} s ({pr:.2f} tok/s) | "
            f"generation: {self.gen_tokens} tok in {self.gen_s:.2f} s ({gr:.2f} tok/s)"
        )


@dataclass
class Generator:
    """Owns one sequence's state (KV cache and any recurrent state) and the token history in it. `pending` is
    the last sampled token, which is not yet in the state (it is decoded at the start of the next step, or
    prepended to the next prompt)."""

    model: Model
    state: SequenceState
    sampler: Sampler
    stop_ids: frozenset = frozenset()
    history: list = field(default_factory=list)
    pending: int | None = None
    stop_reason: str = ""
    stats: Stats = field(default_factory=Stats)
    on_prefill: Callable[[int, int], None] | None = None  # progress of long prompts: (tokens done, total)
    # stop_ids, given once the prompt's forward is done (before the first token is sampled): what they come from
    # (a tokenizer still being built) need not be ready before the forward starts
    stop_ids_after_prompt: Callable[[], frozenset] | None = None

    def reset(self) -> None:
        self.state.truncate(0)
        self.history.clear()
        self.pending = None

    def _step(self, ids: list) -> np.ndarray:
        """Run `ids` through the model at the end of the state. All or nothing: if the forward is interrupted
        (Ctrl-C) or fails, the state is rolled back and the history and pending token are as they were.
        A prompt longer than one prefill chunk reports (done, total) to `on_prefill` after each chunk.
        A recurrent state is saved before and after a prompt: the rollback's point, and where a later
        request that shares this prompt (the server's prefix reuse) can start."""
        n0 = self.state.n
        if len(ids) > 1:
            self.state.save()
        try:
            logits = self.model.forward(np.asarray(ids, dtype=np.int64), self.state, progress=self.on_prefill)
        except BaseException:
            self.state.truncate(min(n0, self.state.n))  # one forward chunk is all or nothing by itself
            raise
        if len(ids) > 1:
            self.state.save()
        self.pending = None
        self.history.extend(ids)
        return logits

    def feed(self, ids) -> np.ndarray:
        """Prefill `ids` (after any pending token); return the logits of the last position."""
        ids = ([self.pending] if self.pending is not None else []) + list(ids)
        t0 = time.perf_counter()
        logits = self._step(ids)
        self.stats.prompt_s += time.perf_counter() - t0
        self.stats.prompt_tokens += len(ids)
        return logits

    def start(self, prompt_ids) -> np.ndarray:
        """Prefill the prompt (feed) and take the stop ids that wait for it; the logits of its last position."""
        logits = self.feed(prompt_ids)
        if self.stop_ids_after_prompt is not None:
            self.stop_ids, self.stop_ids_after_prompt = self.stop_ids_after_prompt(), None
        return logits

    def pick(self, logits: np.ndarray) -> int | None:
        """Sample the next token from `logits`; it becomes pending. None if it ends the generation ('eog')."""
        tok = self.pending = self.sampler(logits, self.history)
        if tok in self.stop_ids:
            self.stop_reason = "eog"
            return None
        return tok

    def generate(self, prompt_ids, n_predict: int = -1) -> Iterator[int]:
        """Yield sampled tokens until an end-of-generation token (not yielded), n_predict tokens (-1: no limit)
        or a full context. stop_reason says which: 'eog', 'length' or 'context'."""
        logits = self.start(prompt_ids)
        n = 0
        while True:
            if n_predict >= 0 and n >= n_predict:
                self.stop_reason = "length"
                return
            tok = self.pick(logits)
            if tok is None:
                return
            n += 1
            yield tok
            if self.state.room() == 0:
                self.stop_reason = "context"
                return
            if n_predict >= 0 and n >= n_predict:
                self.stop_reason = "length"
                return
            t0 = time.perf_counter()
            logits = self._step([tok])  # interrupted: tok stays pending, fed before the next prompt
            self.stats.gen_s += time.perf_counter() - t0
            self.stats.gen_tokens += 1


def step_together(gens: list[Generator]) -> np.ndarray:
    """Decode every generator's pending token in one batched step (Model.step: the FFN's experts read once for
    all of them); returns their logits (len(gens), vocab). All or nothing: if the step fails or is interrupted,
    every pending token stays pending and no state moves."""
    toks = [g.pending for g in gens]
    t0 = time.perf_counter()
    if len(gens) == 1:  # the generator's own one-token step
        g = gens[0]
        logits = g._step(toks)[None]
        g.stats.gen_s += time.perf_counter() - t0
        g.stats.gen_tokens += 1
        return logits
    logits = gens[0].model.step(toks, [g.state for g in gens])
    dt = time.perf_counter() - t0
    for g, tok in zip(gens, toks):
        g.pending = None
        g.history.append(tok)
        g.stats.gen_s += dt
        g.stats.gen_tokens += 1
    return logits


def feed_together(gens: list[Generator], chunks: list[list[int]]) -> np.ndarray:
    """Run each generator's chunk (a prompt's next tokens, or the pending token of a decoding sequence: then
    chunk is [pending]) in one forward (Model.forward_many); returns the logits of each chunk's last token.
    A prompt chunk is timed as prompt, a one-token chunk of a decoding sequence as generation. A recurrent
    state is saved before and after each prompt chunk, as Generator.feed does. All or nothing: on failure no
    state, history or pending token moves."""
    decoding = [len(c) == 1 and g.pending == c[0] for g, c in zip(gens, chunks)]
    if all(decoding):
        return step_together(gens)
    t0 = time.perf_counter()
    if len(gens) == 1:  # one prompt: the generator's own forward
        logits = gens[0]._step(list(chunks[0]))[None]
    else:
        for g, c in zip(gens, chunks):
            if len(c) > 1:
                g.state.save()
        logits = gens[0].model.forward_many(chunks, [g.state for g in gens])
        for g, c in zip(gens, chunks):
            if len(c) > 1:
                g.state.save()
            g.pending = None
            g.history.extend(c)
    dt = time.perf_counter() - t0
    for g, c, dec in zip(gens, chunks, decoding):
        if dec:
            g.stats.gen_s += dt
            g.stats.gen_tokens += 1
        else:
            g.stats.prompt_s += dt
            g.stats.prompt_tokens += len(c)
    return logits
