"""A GGUF file's tensors as the kernels' weight matrices (zero-copy views of the mapping)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from streamer.gguf_file import GGUFFile
from streamer.kernels import QMatrix, int8, lanes


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


def linear_few(w: QMatrix, h: np.ndarray) -> np.ndarray:
    """(m, n_in) -> (m, n_out) for the few rows of a batched decode step on a matrix too big for the CPU's cache
    (the output head): lanes.grouped reads each weight row once for all m rows where it serves the format
    (2026-12-06, 4 rows: 0.54x the time of 4 matvecs), else linear."""
    m = h.shape[0]
    if not 1 < m <= lanes.MAX_TOKENS or w.qtype != T.Q4_K or not lanes.ready():
        return linear(w, h)
    fmt, rows = w.block
    out = np.empty((1, m, w.n_out), np.float32)
    act = int8.quantize(fmt, np.ascontiguousarray(h, np.float32))
    one = np.zeros((1, 1), np.int64)
    lanes.grouped(rows.reshape(-1), one, rows.shape[1], act, np.arange(m), np.array([0, m]), out, lanes.host_isa())
    return out[0]
