"""Perplexity the way llama.cpp's llama-perplexity computes it (tools/perplexity/perplexity.cpp, `perplexity`):

- the whole text is tokenized once (a BOS token is added only if the model's add_bos_token says so: Qwen3's
  does not), and at least 2 * n_ctx tokens are required;
- it is cut into n_tokens // n_ctx non-overlapping windows of n_ctx tokens (fewer with --chunks); each window
  runs from position 0 in an empty KV cache; if the model adds BOS, the window's first token is replaced by BOS;
- only the second half of each window is scored: the logits at positions first .. n_ctx - 2 (first = n_ctx / 2)
  predict tokens first + 1 .. n_ctx - 1, so n_ctx - 1 - first tokens per window (the last position predicts
  nothing, so it is not run: causal attention makes the scored logits the same);
- per token, nll = log(sum exp(l - max)) - (l[target] - max) (float32 logits, the sum in float64);
  the running estimate after window i is exp(mean nll); the final one comes with
  stderr = ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from streamer.errors import StreamerError

MIN_CTX = 4  # the second half of a window must score at least one token
LOGITS_BYTES = 64 * 2**20


@dataclass
class PerplexityResult:
    n_ctx: int
    n_chunk: int
    n_tokens: int  # tokens in the whole text
    add_bos: bool
    count: int = 0  # tokens scored
    nll: float = 0.0  # sums over scored tokens
    nll2: float = 0.0
    running: list[float] = field(default_factory=list)  # [i]ppl after each window
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def stderr(self) -> float:
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return self.ppl * math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else float("nan")

    def to_dict(self) -> dict:
        return {
            "ppl": self.ppl,
            "ppl_stderr": self.stderr,
            "nll_mean": self.nll / self.count,
            "n_ctx": self.n_ctx,
            "chunks": self.n_chunk,
            "tokens": self.n_tokens,
            "tokens_scored": self.count,
            "add_bos": self.add_bos,
            "running_ppl": self.running,
            "seconds": round(self.seconds, 3),
        }


def plan(n_tokens: int, n_ctx: int, chunks: int | None) -> int:
    """The number of windows, or a StreamerError saying why the text does not allow one (llama.cpp's rules)."""
    if n_ctx < MIN_CTX:
        raise StreamerError(f"-c/--ctx-size must be at least {MIN_CTX} for perplexity, got {n_ctx}")
    if chunks is not None and chunks < 1:
        raise StreamerError(f"--chunks must be at least 1, got {chunks}")
    if n_tokens < 2 * n_ctx:
        raise StreamerError(
            f"the text has {n_tokens} tokens; perplexity with a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (llama-perplexity's rule; use a smaller -c/--ctx-size or a longer file)"
        )
    n = n_tokens // n_ctx
    return n if chunks is None else min(chunks, n)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of targets[j] under logits[j] (float32 rows), as llama.cpp's log_softmax."""
    mx = logits.max(axis=1, keepdims=True)
    d = logits - mx
    lse = np.log(np.exp(d).sum(axis=1, dtype=np.float64))
    return lse - d[np.arange(len(targets)), targets].astype(np.float64)


def window_tokens(tokens: np.ndarray, i: int, n_ctx: int, bos_id: int | None) -> np.ndarray:
    w = np.array(tokens[i * n_ctx : (i + 1) * n_ctx], dtype=np.int64)
    if bos_id is not None:
        w[0] = bos_id
    return w


def perplexity(
    model,
    tokens,
    n_ctx: int,
    chunks: int | None = None,
    bos_id: int | None = None,
    on_chunk: Callable[[int, PerplexityResult, float], None] | None = None,
) -> PerplexityResult:
    """Run llama-perplexity's method over `tokens` with `model` (a streamer.model.Model whose context holds at
    least n_ctx). bos_id: replace each window's first token by it (models that add BOS). on_chunk(i, result,
    seconds of this window) after each window."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n_chunk = plan(len(tokens), n_ctx, chunks)
    if model.n_ctx < n_ctx:
        raise StreamerError(f"the model was opened with a context of {model.n_ctx}, less than {n_ctx}")
    res = PerplexityResult(n_ctx, n_chunk, len(tokens), bos_id is not None)
    first = n_ctx // 2
    # logits are (rows, vocab) float32: a slice of the scored half at a time keeps them under LOGITS_BYTES
    step = max(1, min(model.ubatch, LOGITS_BYTES // (4 * model.cfg.n_vocab)))
    cache = model.new_state()
    t_all = time.perf_counter()
    for i in range(n_chunk):
        t0 = time.perf_counter()
        w = window_tokens(tokens, i, n_ctx, bos_id)
        cache.truncate(0)
        model.forward(w[:first], cache)  # the unscored first half (only its last logits are computed)
        # positions first .. n_ctx - 2 predict tokens first + 1 .. n_ctx - 1; the last position has no target
        for s in range(first, n_ctx - 1, step):
            e = min(s + step, n_ctx - 1)
            nll = token_nll(model.forward(w[s:e], cache, all_logits=True), w[s + 1 : e + 1])
            res.nll += float(nll.sum())
            res.nll2 += float((nll * nll).sum())
            res.count += len(nll)
        res.running.append(res.ppl)
        if on_chunk is not None:
            on_chunk(i, res, time.perf_counter() - t0)
    res.seconds = time.perf_counter() - t_all
    return res
