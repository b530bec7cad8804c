"""Per-layer K/V storage preallocated for the whole context. K is stored after RoPE. Entries are float16
(kept as uint16 bit patterns, since numba has no CPU float16; ggml's default KV type too): half the memory
of float32. Memory comes from np.zeros (calloc), so pages are only committed as positions are filled."""

from __future__ import annotations

import numpy as np

from streamer.config import ModelConfig
from streamer.errors import StreamerError


def check_room(n: int, m: int, n_ctx: int) -> None:
    """m more tokens after n must fit a context of n_ctx."""
    if n + m > n_ctx:
        raise StreamerError(
            f"context overflow: {n} + {m} tokens exceed the context size {n_ctx} (raise it with -c/--ctx-size)"
        )


class KVCache:
    def __init__(self, cfg: ModelConfig, n_ctx: int):
        if n_ctx <= 0:
            raise StreamerError(f"context size must be positive, got {n_ctx}")
        shape = (cfg.n_layer, cfg.n_head_kv, n_ctx, cfg.head_dim)  # (layer, kv head, position, channel)
        self.k = np.zeros(shape, dtype=np.uint16)
        self.v = np.zeros(shape, dtype=np.uint16)
        self.n_ctx = n_ctx
        self.n = 0  # positions filled

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def room(self) -> int:
        return self.n_ctx - self.n

    def check_room(self, m: int) -> None:
        check_room(self.n, m, self.n_ctx)

    def store(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: (m, n_kv, head_dim) for positions pos0 .. pos0+m-1."""
        from streamer.kernels import ops  # here: check_room serves the CLI's checks, which must not import numba

        ops.store_kv(k, v, self.k[layer], self.v[layer], pos0)

    def truncate(self, n: int) -> None:
        """Forget positions >= n (their slots are simply overwritten later)."""
        assert 0 <= n <= self.n
        self.n = n
