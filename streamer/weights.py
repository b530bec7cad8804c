"""A GGUF file's tensors as the kernels' weight matrices (zero-copy views of the mapping)."""

from __future__ import annotations

import numpy as np

from streamer.gguf_file import GGUFFile
from streamer.kernels import QMatrix


def qmatrix(gf: GGUFFile, name: str, expert: int | None = None) -> QMatrix:
    """A weight as a zero-copy QMatrix; for a 3-D expert stack, the slab of one expert."""
    t = gf.tensors[name]
    if expert is None:
        return QMatrix(gf.view(name), t.qtype, t.shape[-1], name)
    return QMatrix(gf.view(name)[expert], t.qtype, t.shape[-1], f"{name}[{expert}]")


MATVEC_ROWS = 3  # up to this many rows, one matvec per row beats a dequantized tile (measured on 768x2048)


def linear(w: QMatrix, h: np.ndarray) -> np.ndarray:
    """(m, n_in) -> (m, n_out): matrix-vector kernels for a few rows (decode, and the many experts that get
    only a token or two of a prefill), matrix-matrix otherwise."""
    m = h.shape[0]
    if m <= MATVEC_ROWS:
        out = np.empty((m, w.n_out), np.float32)
        for i in range(m):
            w.matvec(h[i], out[i])
        return out
    return w.matmul(h)
