"""The MoE prefill's experts with a few tokens each (Q4_K): simd_lanes.py's row kernel, many experts per call.

pack lays each expert's quantized activation rows (int8.quantize's, gathered by row index) out in lanes of T =
16 / C tokens (C from the expert's token count: lanes_c); grouped computes, for every part j (gate, up; or the
down alone) and expert i of a group, out[j, starts[i] + t] = W_ji . x_t for the expert's tokens, one parallel
call over (part, expert, block of rows), the work split between threads by its cost. The error bound is
simd_lanes.py's.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..formats import Q4_K
from ._bits import FASTMATH, kernel
from .simd_lanes import (
    ROWS,
    q4_k_lanes_generic_1,
    q4_k_lanes_generic_2,
    q4_k_lanes_generic_4,
    q4_k_lanes_generic_8,
    q4_k_lanes_vnni_1,
    q4_k_lanes_vnni_2,
    q4_k_lanes_vnni_4,
    q4_k_lanes_vnni_8,
)

_R1, _R2, _R4, _R8 = ROWS[1], ROWS[2], ROWS[4], ROWS[8]  # rows per intrinsic call, by C (numba globals)
MAX_TOKENS = 16  # the most tokens one pass holds (C = 1)
ROW_BLOCK = 32  # rows per work item


def lanes_c(n: np.ndarray) -> np.ndarray:
    """Chunks per token lane group for experts with n tokens (1..16): T = 16 / C is n rounded up to 2, 4, 8, 16."""
    t = np.maximum(2, 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
    return 16 // t


@kernel(parallel=True)
def pack(xq, dx, xs, rows, starts, cs, xoffs, loffs, xt, dl, sl):
    """Expert i's activation rows rows[starts[i]]..rows[starts[i+1]-1] (of int8.quantize's xq, dx, xs; per 32
    elements) -> its lanes: xt[xoffs[i]:] (per sub-block g, vector s < 8 / C, digit d: 16 lanes of 4 bytes,
    lane t * C + c' = token t's chunk 8g + Cs + c', zero past its tokens), dl / sl[loffs[i]:] (per g, 16 lanes:
    dx[t, g]; xs[t, g] in lane c' = 0, else 0). C = cs[i]."""
    xw = xq.view(np.int32)  # [rows, K / 2]: dword 2k + d = digit d of elements 4k..4k+3
    ng = dx.shape[1]
    xtw = xt.view(np.int32)
    for i in prange(starts.size - 1):
        C = cs[i]
        nv = 8 // C
        a, n = starts[i], starts[i + 1] - starts[i]
        xo, lo = xoffs[i] >> 2, loffs[i]
        for g in range(ng):
            for lane in range(16):
                t = lane // C
                cp = lane - t * C
                at = lo + g * 16 + lane
                if t < n:
                    r = rows[a + t]
                    dl[at] = dx[r, g]
                    sl[at] = xs[r, g] if cp == 0 else np.float32(0)
                    for s in range(nv):
                        k = 8 * g + C * s + cp
                        base = xo + (g * nv + s) * 32 + lane
                        xtw[base] = xw[r, 2 * k]
                        xtw[base + 16] = xw[r, 2 * k + 1]
                else:
                    dl[at] = 0
                    sl[at] = 0
                    for s in range(nv):
                        base = xo + (g * nv + s) * 32 + lane
                        xtw[base] = 0
                        xtw[base + 16] = 0


@kernel(fastmath=FASTMATH, inline="always")
def _row_vnni(C, w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n):
    if C == 1:
        q4_k_lanes_vnni_1(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    elif C == 2:
        q4_k_lanes_vnni_2(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    elif C == 4:
        q4_k_lanes_vnni_4(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    else:
        q4_k_lanes_vnni_8(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)


@kernel(fastmath=FASTMATH, inline="always")
def _row_generic(C, w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n):
    if C == 1:
        q4_k_lanes_generic_1(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    elif C == 2:
        q4_k_lanes_generic_2(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    elif C == 4:
        q4_k_lanes_generic_4(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
    else:
        q4_k_lanes_generic_8(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)


@kernel(fastmath=FASTMATH, inline="always")
def _rows(C):
    return _R1 if C == 1 else _R2 if C == 2 else _R4 if C == 4 else _R8


@kernel(fastmath=FASTMATH, inline="always")
def _item(q, g, nt):
    """Work item q -> (part j, expert i, row block t), items in that order."""
    j = q // (g * nt)
    rest = q - j * g * nt
    i = rest // nt
    return j, i, rest - i * nt


@kernel(parallel=True, fastmath=FASTMATH)
def grouped_vnni(w, offs, row_bytes, xt, dl, sl, xoffs, loffs, cs, starts, bounds, out):
    """Rows of every (part, expert) by vpdpbusd; thread slot s computes work items bounds[s]..bounds[s+1]."""
    parts, g = offs.shape
    P, n_out = out.shape[1], out.shape[2]
    nb = row_bytes // 144
    nt = (n_out + ROW_BLOCK - 1) // ROW_BLOCK
    for s in prange(bounds.size - 1):
        for q in range(bounds[s], bounds[s + 1]):
            j, i, t = _item(q, g, nt)
            a, n = starts[i], starts[i + 1] - starts[i]
            if n > 0:
                end = min(n_out, (t + 1) * ROW_BLOCK)
                for r in range(t * ROW_BLOCK, end, _rows(cs[i])):
                    o = offs[j, i] + r * row_bytes
                    xo, lo, d = xoffs[i], loffs[i], (j * P + a) * n_out + r
                    _row_vnni(cs[i], w, o, row_bytes, end - r, nb, xt, xo, dl, sl, lo, out, d, n_out, n)


@kernel(parallel=True, fastmath=FASTMATH)
def grouped_generic(w, offs, row_bytes, xt, dl, sl, xoffs, loffs, cs, starts, bounds, out):
    """As grouped_vnni, with the portable integer dot."""
    parts, g = offs.shape
    P, n_out = out.shape[1], out.shape[2]
    nb = row_bytes // 144
    nt = (n_out + ROW_BLOCK - 1) // ROW_BLOCK
    for s in prange(bounds.size - 1):
        for q in range(bounds[s], bounds[s + 1]):
            j, i, t = _item(q, g, nt)
            a, n = starts[i], starts[i + 1] - starts[i]
            if n > 0:
                end = min(n_out, (t + 1) * ROW_BLOCK)
                for r in range(t * ROW_BLOCK, end, _rows(cs[i])):
                    o = offs[j, i] + r * row_bytes
                    xo, lo, d = xoffs[i], loffs[i], (j * P + a) * n_out + r
                    _row_generic(cs[i], w, o, row_bytes, end - r, nb, xt, xo, dl, sl, lo, out, d, n_out, n)


GROUPED = {"vnni": grouped_vnni, "generic": grouped_generic}

# Cost of a work item (a block of rows) in units of one row dotted with one lane vector's worth of tokens, beyond
# the lanes themselves: the row's scale setup and weight loads (simd_lanes: per super-block, shared by the lanes).
ROW_COST = 1.0


def _aligned(n: int, dtype) -> np.ndarray:
    """n elements starting on a 64-byte boundary (every lane vector then is one cache line)."""
    size = np.dtype(dtype).itemsize
    raw = np.empty(n * size + 64, np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at : at + n * size].view(dtype)


def grouped(
    w: np.ndarray,
    offs: np.ndarray,
    row_bytes: int,
    act,
    rows: np.ndarray,
    starts: np.ndarray,
    out: np.ndarray,
    isa: str,
) -> None:
    """For part j and expert i (out.shape[2] Q4_K rows of row_bytes at byte offs[j, i] of the flat uint8 w):
    out[j, starts[i] + t] = W_ji . (activation row rows[starts[i] + t] of act, int8.quantize's with 2 digits),
    for t < starts[i+1] - starts[i] <= MAX_TOKENS. isa: 'vnni' or 'generic'."""
    parts, g = offs.shape
    n_out = out.shape[2]
    ng = act.dx.shape[1]
    cnt = np.diff(starts)
    cs = lanes_c(cnt)
    xbytes = ng * 128 * (8 // cs)  # per expert: per sub-block, 8 / C vectors x 2 digits x 64 bytes
    xoffs = np.concatenate(([0], np.cumsum(xbytes)[:-1])).astype(np.int64)
    loffs = (np.arange(g, dtype=np.int64) * ng * 16).astype(np.int64)
    xt = _aligned(int(xbytes.sum()), np.int8)
    dl = _aligned(g * ng * 16, np.float32)
    sl = _aligned(g * ng * 16, np.float32)
    pack(act.xq, act.dx, act.xs, rows, starts, cs, xoffs, loffs, xt, dl, sl)
    nt = -(-n_out // ROW_BLOCK)
    cost = np.where(cnt > 0, 8.0 / cs + ROW_COST, 0.0)  # lane vectors per sub-block, + the row's own work
    cum = np.cumsum(np.broadcast_to(np.repeat(cost, nt), (parts, g * nt)).reshape(-1))
    T = numba.get_num_threads()
    bounds = np.searchsorted(cum, cum[-1] * np.arange(T + 1) / T, side="right") if len(cum) else np.zeros(T + 1)
    bounds = bounds.astype(np.int64)
    bounds[0], bounds[-1] = 0, len(cum)
    GROUPED[isa](w, offs, row_bytes, xt, dl, sl, xoffs, loffs, cs, starts, bounds, out)
