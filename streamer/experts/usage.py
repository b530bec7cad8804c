"""Learned pinning: per-(layer, expert) routing counts, kept in a small sidecar usage file in the user's cache
directory (never in the GGUF), and the choice of which experts to pin from them.

A flat histogram pins nothing: an expert is pinned only if its count stands clearly above what uniform
routing would give (mean + 4 standard deviations of a Poisson count, and at least twice the mean)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from streamer.gguf_file import model_key
from streamer.io import atomic_write

FORMAT = "stream-run-usage/1"

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """$STREAM_RUN_CACHE, else $XDG_CACHE_HOME/stream-run, else ~/.cache/stream-run."""
    if os.environ.get("STREAM_RUN_CACHE"):
        return Path(os.environ["STREAM_RUN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stream-run"


def sidecar_path(gf) -> Path:
    return cache_dir() / "usage" / f"{Path(gf.path).stem}-{model_key(gf)}.json"


def load_counts(path: Path, key: str, n_layer: int, n_expert: int) -> np.ndarray | None:
    """The saved (n_layer, n_expert) counts, or None (with a warning) if missing, corrupt or foreign."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        counts = np.asarray(d["counts"], dtype=np.float64)
        ok = d.get("format") == FORMAT and d.get("model") == key and counts.shape == (n_layer, n_expert)
        if not ok or not np.all(np.isfinite(counts)) or (counts < 0).any():
            logger.warning(f"ignoring expert-usage file {path}: it is for another model or format")
            return None
        return counts
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning(f"ignoring unreadable expert-usage file {path}: {e}")
        return None


def save_counts(path: Path, key: str, counts: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "model": key, "counts": counts.round(3).tolist()}
    atomic_write(path, lambda f: f.write(json.dumps(doc).encode()))


def choose_pins(counts: np.ndarray | None, capacity: int) -> list[tuple[int, int]]:
    """Up to `capacity` (layer, expert) pairs, hottest first, among those clearly above uniform use."""
    if counts is None or capacity <= 0:
        return []
    mean = counts.mean(axis=1, keepdims=True)
    hot = (counts >= mean + 4.0 * np.sqrt(np.maximum(mean, 1.0))) & (counts >= 2.0 * mean) & (mean > 0)
    layers, experts = np.nonzero(hot)
    share = counts[layers, experts] / np.maximum(counts.sum(axis=1)[layers], 1.0)
    order = np.argsort(-share, kind="stable")[:capacity]
    return [(int(layers[i]), int(experts[i])) for i in order]


class Usage:
    """Counts for this run, merged with the saved file on save()."""

    def __init__(self, gf, n_layer: int, n_expert: int, learn: bool = True):
        self.learn = learn
        self.counts = np.zeros((n_layer, n_expert), dtype=np.float64)
        self.path = sidecar_path(gf) if learn else None
        self.key = model_key(gf) if learn else ""
        self.saved = load_counts(self.path, self.key, n_layer, n_expert) if learn else None

    def record(self, layer: int, experts) -> None:
        self.counts[layer] += np.bincount(np.asarray(experts, dtype=np.int64), minlength=self.counts.shape[1])

    def pins(self, capacity: int) -> list[tuple[int, int]]:
        return choose_pins(self.saved, capacity)

    def save(self) -> None:
        if not self.learn or not self.counts.any():
            return
        total = self.counts + (self.saved if self.saved is not None else 0.0)
        try:
            save_counts(self.path, self.key, total)
        except OSError as e:
            logger.warning(f"could not save the expert-usage file {self.path}: {e}")
