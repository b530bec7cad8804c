"""What one sequence keeps between forwards: how many positions it holds, and per layer its token mixer's state
(K/V rows for attention; a fixed-size recurrent state for a linear-attention layer). The session, chat, the
server's prefix reuse and perplexity use SequenceState without knowing which kinds of layers are inside.

Attention rows can be cut back to any position. A recurrent state cannot: it can only return to a position
where it was saved. So a forward is all or nothing (`commit` adopts the new recurrent state only once every
layer has run), `save()` keeps the recurrent state at chosen positions (Generator saves before and after each
prompt), and `restorable(n)` says the furthest position at or before n the state can be cut back to.
"""

from __future__ import annotations

import mmap

import numpy as np

from streamer.errors import StreamerError

SAVED_MAX = 4  # recurrent snapshots kept: rollback of a prompt, reuse of the last turns' prefixes


def check_room(n: int, m: int, n_ctx: int) -> None:
    """m more tokens after n must fit a context of n_ctx."""
    if n + m > n_ctx:
        raise StreamerError(
            f"context overflow: {n} + {m} tokens exceed the context size {n_ctx} (raise it with -c/--ctx-size)"
        )


def small_page_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeroed memory of its own mapping, which the kernel fills in 4 KiB pages as it is first written, never in
    2 MiB ones (MADV_NOHUGEPAGE; numpy asks for huge pages on arrays of 4 MiB and more). A K/V array is written
    a few rows at a time: a huge page would zero 2 MiB at the first row of each head, which on a VM whose free
    memory went back to its host cost about 10 ms a fault (2026-12-06)."""
    count = int(np.prod(shape, dtype=np.int64))
    m = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)  # Linux only, as the project
    return np.frombuffer(m, dtype, count).reshape(shape)


class KVRows:
    """One attention layer's K and V, float16 bit patterns (numba has no CPU float16; ggml's default KV type),
    (kv head, position, channel), K after RoPE. Zeroed mappings in small pages: memory is committed as positions
    fill (small_page_zeros)."""

    recurrent = False

    def __init__(self, n_kv: int, n_ctx: int, head_dim: int):
        self.k = small_page_zeros((n_kv, n_ctx, head_dim), np.uint16)
        self.v = small_page_zeros((n_kv, n_ctx, head_dim), np.uint16)
        self.nbytes = self.k.nbytes + self.v.nbytes


class Recurrent:
    """A linear-attention layer's state as named float32 arrays (e.g. a conv window and a delta-rule matrix),
    twice: `cur` is the committed state, `new` the one a forward writes. A forward reads cur (its first token)
    and writes new; commit swaps them, so an interrupted forward leaves cur as it was."""

    recurrent = True

    def __init__(self, **shapes: tuple[int, ...]):
        self.cur = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        self.new = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        self.nbytes = 2 * sum(a.nbytes for a in self.cur.values())

    def commit(self) -> None:
        self.cur, self.new = self.new, self.cur

    def load(self, saved: dict | None) -> None:
        for k, a in self.cur.items():
            if saved is None:
                a.fill(0)
            else:
                a[...] = saved[k]


class SequenceState:
    def __init__(self, layers: list, n_ctx: int):
        if n_ctx <= 0:
            raise StreamerError(f"context size must be positive, got {n_ctx}")
        self.layers, self.n_ctx = layers, n_ctx
        self.n = 0  # positions filled
        self._rec = [s for s in layers if s.recurrent]
        self._saved: dict[int, list] = {}  # position -> each recurrent layer's arrays

    @property
    def nbytes(self) -> int:
        """Every layer's state and the saved recurrent snapshots."""
        saved = sum(a.nbytes for layers in self._saved.values() for arrays in layers for a in arrays.values())
        return sum(s.nbytes for s in self.layers) + saved

    def room(self) -> int:
        return self.n_ctx - self.n

    def check_room(self, m: int) -> None:
        check_room(self.n, m, self.n_ctx)

    def commit(self, m: int) -> None:
        """A forward of m tokens ran through every layer: they are now part of the sequence."""
        for s in self._rec:
            s.commit()
        self.n += m

    def save(self) -> None:
        """Keep the recurrent state at this position, so truncate() can come back to it (attention needs
        nothing). The oldest of more than SAVED_MAX snapshots is dropped."""
        if not self._rec or self.n in self._saved:
            return
        self._saved[self.n] = [{k: a.copy() for k, a in s.cur.items()} for s in self._rec]
        while len(self._saved) > SAVED_MAX:
            del self._saved[min(self._saved)]

    def restorable(self, n: int) -> int:
        """The furthest position <= n that truncate() can return to."""
        if not self._rec or n >= self.n:
            return min(n, self.n)
        return max([p for p in self._saved if p <= n], default=0)

    def truncate(self, n: int) -> None:
        """Forget positions >= n (attention slots are overwritten later; a recurrent state is reloaded)."""
        assert 0 <= n <= self.n
        if self._rec and n != self.n:
            if n != 0 and n not in self._saved:
                raise StreamerError(f"cannot return to position {n}: this model's recurrent state was not saved there")
            for i, s in enumerate(self._rec):
                s.load(self._saved[n][i] if n else None)
            self._saved = {p: v for p, v in self._saved.items() if p <= n}
        self.n = n
