"""The MoE prefill's experts with a few tokens each (Q4_K): simd_lanes.py's row kernel, many experts per call.

pack lays each expert's quantized activation rows (int8.quantize's, picked by row index) out in simd_lanes.py's
lanes of T tokens (the expert's count rounded up to 2, 4, 8 or 16: lanes_t; an expert with 9-12 tokens runs as
two passes, 8 tokens and the rest: split_lanes); grouped computes, for every part j
(gate and up, or the down alone) and expert i of a group, out[j, starts[i] + t] = W_ji . x_t for the expert's
tokens, in one parallel call over (part, expert, block of rows), the work split between the threads by its cost.
The error bound is simd_lanes.py's.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np
from numba import prange

from . import int8
from ._bits import FASTMATH, isa_kernels, kernel
from .int8 import _item  # work item -> (part, expert, row block), as the grouped integer kernel's
from .simd_lanes import KERNELS, ROWS, ROWS_AVX2

_R2, _R4, _R8, _R16 = ROWS[2], ROWS[4], ROWS[8], ROWS[16]  # rows per intrinsic call, by T (numba globals)
MAX_TOKENS = 16  # the most tokens one pass holds
ROW_BLOCK = 32  # rows per work item


def lanes_t(n: np.ndarray) -> np.ndarray:
    """The lane layout's token count for experts with n tokens (0..16): n rounded up to 2, 4, 8 or 16."""
    return np.maximum(2, 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))


@kernel(parallel=True)
def pack(digits, xq, dx, xs, rows, starts, ts, xoffs, loffs, xt, dl, sl):
    """Expert i's activation rows rows[starts[i]]..rows[starts[i+1]-1] (of int8.quantize's xq, dx, xs, with
    `digits` digits; per 32 elements), T = ts[i] lanes' worth (zeros past its tokens), Tv = min(T, 8) tokens per
    vector, V = T / Tv vectors, Cp = 8 / Tv chunks (of 4 elements) per lane group: for chunk run q (sub-blocks 2q,
    2q + 1), s < Tv, v < V, digit d: 64 bytes at xt[xoffs[i] + 64 (digits (T q + V s + v) + d)], lane L (4 bytes)
    = token v Tv + t's chunk Cp s + c' of sub-block 2q + k, with L = 2 Cp t + Cp k + c'; and at dl / sl[loffs[i]
    + 16 (V q + v) + L] that token's dx of that sub-block, and its xs in the lanes c' = 0 (else 0)."""
    xw = xq.view(np.int32)  # [rows, digits K / 4]: dword digits k + d = digit d of elements 4k..4k+3
    nq = dx.shape[1] >> 1
    xtw = xt.view(np.int32)
    for i in prange(starts.size - 1):
        T = ts[i]
        Tv = min(T, 8)
        V = T // Tv
        Cp = 8 // Tv
        a, n = starts[i], starts[i + 1] - starts[i]
        xo, lo = xoffs[i] >> 2, loffs[i]
        for q in range(nq):
            for v in range(V):
                for L in range(16):
                    t = L // (2 * Cp)
                    k = (L // Cp) & 1
                    cp = L - (L // Cp) * Cp
                    tok = v * Tv + t
                    g = 2 * q + k
                    at = lo + (V * q + v) * 16 + L
                    if tok < n:
                        r = rows[a + tok]
                        dl[at] = dx[r, g]
                        sl[at] = xs[r, g] if cp == 0 else np.float32(0)
                        for s in range(Tv):
                            k4 = 8 * g + Cp * s + cp
                            base = xo + 16 * digits * (T * q + V * s + v) + L
                            for d in range(digits):
                                xtw[base + 16 * d] = xw[r, digits * k4 + d]
                    else:
                        dl[at] = 0
                        sl[at] = 0
                        for s in range(Tv):
                            base = xo + 16 * digits * (T * q + V * s + v) + L
                            for d in range(digits):
                                xtw[base + 16 * d] = 0


def _dispatch(isa, digits):
    """The row intrinsic of isa and digits for an expert's T; AVX2 has none for T = 16 (lanes.SPLIT_AVX2 cuts those
    experts into passes of 8, and grouped checks): each intrinsic is inlined once."""
    k2, k4, k8 = (KERNELS[isa, digits, T] for T in (2, 4, 8))
    k16 = KERNELS.get((isa, digits, 16))

    @kernel(fastmath=FASTMATH, inline="always")
    def row(T, w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n):  # T <= 8
        if T == 8:
            k8(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
        elif T == 4:
            k4(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
        else:
            k2(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)

    if k16 is None:
        return row

    @kernel(fastmath=FASTMATH, inline="always")
    def row16(T, w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n):
        if T == 16:
            k16(w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)
        else:
            row(T, w, off, rb, nr, nb, xt, xo, dl, sl, lo, dst, doff, ld, n)

    return row16


# _row_<isa>_<digits>: module globals, so that each grouped version's pruned branches name the ones it keeps
_row_vnni_1, _row_vnni_2 = _dispatch("vnni", 1), _dispatch("vnni", 2)
_row_generic_1, _row_generic_2 = _dispatch("generic", 1), _dispatch("generic", 2)
_row_avx2_1, _row_avx2_2 = _dispatch("avx2", 1), _dispatch("avx2", 2)


_A2, _A4, _A8 = ROWS_AVX2[2], ROWS_AVX2[4], ROWS_AVX2[8]


@kernel(fastmath=FASTMATH, inline="always")
def _rows_avx2(T):
    return _A8 if T == 8 else _A4 if T == 4 else _A2


@kernel(fastmath=FASTMATH, inline="always")
def _rows(T):
    return _R16 if T == 16 else _R8 if T == 8 else _R4 if T == 4 else _R2


def _grouped_source(isa, digits):
    def grouped(w, offs, row_bytes, xt, dl, sl, xoffs, loffs, ts, starts, bounds, out):
        """Rows of every (part, expert) by the lanes kernels of `isa` (vpdpbusd, its AVX2 form simd_vnni._dp2_avx2,
        or the portable integer dot) on `digits` activation digits; thread slot s computes work items
        bounds[s]..bounds[s+1]."""
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
                    step = _rows_avx2(ts[i]) if isa == "avx2" else _rows(ts[i])
                    for r in range(t * ROW_BLOCK, end, step):
                        o = offs[j, i] + r * row_bytes
                        xo, lo, d, nr = xoffs[i], loffs[i], (j * P + a) * n_out + r, end - r
                        if isa == "vnni":
                            if digits == 1:
                                _row_vnni_1(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)
                            else:
                                _row_vnni_2(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)
                        elif isa == "avx2":
                            if digits == 1:
                                _row_avx2_1(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)
                            else:
                                _row_avx2_2(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)
                        elif digits == 1:
                            _row_generic_1(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)
                        else:
                            _row_generic_2(ts[i], w, o, row_bytes, nr, nb, xt, xo, dl, sl, lo, out, d, n_out, n)

    return grouped


ISAS = ("vnni", "generic", "avx2")
# (isa, activation digits) -> the grouped kernel; the two-digit ones keep their names (and numba cache files)
GROUPED = {
    (isa, digits): k
    for digits in (1, 2)
    for isa, k in isa_kernels(
        partial(_grouped_source, digits=digits),
        ISAS,
        "grouped" if digits == 2 else "grouped_d1",
        parallel=True,
        fastmath=FASTMATH,
    ).items()
}


def kernels(isas, digits: int | None = None) -> tuple:
    """The grouped kernels of these instruction sets for `digits` activation digits (default int8.DIGITS)."""
    return tuple(GROUPED[isa, digits or int8.DIGITS] for isa in isas)


def isas() -> list[str]:
    """The instruction sets lanes.grouped can use on this CPU: int8.usable_isas(), and "avx2" where it has AVX2."""
    return int8.usable_isas() + (["avx2"] if int8.host_has_avx2() else [])


def host_isa() -> str | None:
    """The instruction set the MoE prefill's lanes run with here: int8.ISA where the integer prefill kernel runs;
    else "avx2" where the decode's digit row dots run on AVX2 (int8.DECODE_ISA: a CPU without VNNI, STREAM_RUN_ISA
    unset), although the larger experts' matmuls keep the f32 tiles there; else None (the tiles serve every
    expert)."""
    if int8.ISA is not None:
        return int8.ISA
    return "avx2" if int8.DECODE_ISA == "avx2" else None


def ready() -> bool:
    """lanes.grouped runs here: an instruction set for it (host_isa)."""
    return host_isa() is not None


# Cost of a work item (a block of rows) in units of one row dotted with one lane vector's worth of tokens, beyond
# the lanes themselves: the row's scale setup and weight loads (simd_lanes: per super-block, shared by the lanes).
ROW_COST = 2.0
SPLIT = (9, 12)  # experts with this many tokens take two passes (split_lanes)
SPLIT_AVX2 = (9, 16)  # on AVX2: T = 16 lanes ran 8.6 ns per (row, token, super-block), T = 8 6.4 (simd_lanes)


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
    out[j, starts[i] + t] = W_ji . (activation row rows[starts[i] + t] of act, int8.quantize's with one or two
    digits), for t < starts[i+1] - starts[i] <= MAX_TOKENS. isa: one of isas()."""
    parts, g = offs.shape
    n_out = out.shape[2]
    ng = act.dx.shape[1]
    digits = act.xq.shape[1] // (32 * ng)
    offs, starts = split_lanes(offs, starts, SPLIT_AVX2 if isa == "avx2" else SPLIT)
    cnt = np.diff(starts)
    ts = lanes_t(cnt)
    if isa == "avx2" and ts.max(initial=0) > 8:  # AVX2's kernels hold 8 tokens (SPLIT_AVX2 cuts the rest)
        raise ValueError("AVX2 lanes take at most 8 tokens per pass")
    V = ts // np.minimum(ts, 8)
    xoffs = np.concatenate(([0], np.cumsum(ng * 32 * digits * ts)[:-1])).astype(np.int64)  # digits K bytes a token
    loffs = np.concatenate(([0], np.cumsum((ng >> 1) * 16 * V)[:-1])).astype(np.int64)
    xt = _aligned(int(ng * 32 * digits * ts.sum()), np.int8)
    nl = int((ng >> 1) * 16 * V.sum())
    dl = _aligned(nl, np.float32)
    sl = _aligned(nl, np.float32)
    pack(digits, act.xq, act.dx, act.xs, rows, starts, ts, xoffs, loffs, xt, dl, sl)
    bounds = _bounds(np.where(cnt > 0, ts + ROW_COST, 0.0), parts, n_out)  # lane vectors, + the row's own work
    GROUPED[isa, digits](w, offs, row_bytes, xt, dl, sl, xoffs, loffs, ts, starts, bounds, out)


def split_lanes(offs: np.ndarray, starts: np.ndarray, split=SPLIT) -> tuple[np.ndarray, np.ndarray]:
    """Experts with split[0]..split[1] tokens as two passes over their rows, 8 tokens and the rest (an expert's
    column of offs repeated, its range of starts cut after 8 tokens): T = 16 lanes would compute 4-7 lanes of
    zeros, two passes compute T = 8 and T = 2 or 4 lanes and set up each row's scales twice. Whether a token's
    lanes are split, and where it lands, depends only on its expert's count and its rank there, as T does."""
    cnt = np.diff(starts)
    two = (cnt >= split[0]) & (cnt <= split[1])
    if not two.any():
        return offs, starts
    idx = np.repeat(np.arange(cnt.size), 1 + two)
    second = np.concatenate(([False], idx[1:] == idx[:-1]))
    # C order, as the offsets the caller passes (numpy's offs[:, idx] is F order: another compiled version)
    return np.ascontiguousarray(offs[:, idx]), np.append(starts[idx] + 8 * second, starts[-1])


def _bounds(cost: np.ndarray, parts: int, n_out: int) -> np.ndarray:
    """Work items (part, expert, row block) split between the threads by cost (per expert's row block)."""
    g = cost.size
    nt = -(-n_out // ROW_BLOCK)
    cum = np.cumsum(np.broadcast_to(np.repeat(cost, nt), (parts, g * nt)).reshape(-1))
    T = numba.get_num_threads()
    bounds = np.searchsorted(cum, cum[-1] * np.arange(T + 1) / T, side="right") if len(cum) else np.zeros(T + 1)
    bounds = bounds.astype(np.int64)
    bounds[0], bounds[-1] = 0, len(cum)
    return bounds
