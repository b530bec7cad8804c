"""Token sampling: penalties over recent tokens, top-k, temperature softmax, top-p, min-p, one seeded draw.
Greedy (argmax after penalties) when temperature <= 0. Same seed, same tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamer.errors import StreamerError


@dataclass(frozen=True)
class SamplerParams:
    temperature: float = 0.0
    top_k: int = 40  # <= 0: all tokens; defaults follow llama.cpp
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # llama.cpp's: logit / p if > 0 else logit * p
    repeat_last_n: int = 64  # window for all three penalties; 0 disables them, -1 means the whole history
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: a random seed

    def check(self) -> None:
        if not 0.0 <= self.top_p <= 1.0:
            raise StreamerError(f"--top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise StreamerError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise StreamerError(f"--repeat-penalty must be positive, got {self.repeat_penalty}")


def apply_penalties(logits: np.ndarray, history, p: SamplerParams) -> np.ndarray:
    """Return logits with repetition / frequency / presence penalties for the last repeat_last_n tokens."""
    n = len(history) if p.repeat_last_n < 0 else p.repeat_last_n
    if (
        n == 0
        or len(history) == 0
        or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)
    ):
        return logits
    ids, counts = np.unique(np.asarray(history[-n:], dtype=np.int64), return_counts=True)
    out = logits.astype(np.float32, copy=True)
    sel = out[ids]
    sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
    out[ids] = sel - counts * p.frequency_penalty - p.presence_penalty
    return out


def filter_probs(logits: np.ndarray, p: SamplerParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities (summing to 1, descending) after top-k, temperature, top-p, min-p."""
    k = len(logits) if p.top_k <= 0 else min(p.top_k, len(logits))
    ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    z = logits[ids].astype(np.float64) / p.temperature
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    if p.top_p < 1.0:  # smallest prefix whose mass reaches top_p
        cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:cut], probs[:cut]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs[0]
        ids, probs = ids[keep], probs[keep]
    return ids, probs / probs.sum()


class Sampler:
    def __init__(self, params: SamplerParams):
        params.check()
        self.params = params
        self.seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (2**32))
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        p = self.params
        logits = apply_penalties(logits, history, p)
        if p.temperature <= 0:
            return int(np.argmax(logits))
        ids, probs = filter_probs(logits, p)
        return int(ids[np.searchsorted(np.cumsum(probs), self.rng.random(), side="right").clip(0, len(ids) - 1)])
