"""The integer prefill matmul: activations quantized per group to int16 held as two int8 digits, or to one (ggml's int8
grid) on AVX2 (activation_digits), weight tiles unpacked to bytes, integer dot products (simd_i8.py, where the error
bound is derived).

grouped_matmul is the MoE prefill's form: many experts' matrices (each with its own few tokens) in one parallel call, on
activation rows quantized once (quantize, gather); each row's result equals matmul's bit for bit.

Formats: Q8_0, Q4_0, Q4_K, Q5_K (groups of 32) and Q6_K (groups of 16); the others keep blocks.block_matmul's f32
tiles. The instruction set is chosen here, in Python, once (host_isa), since a choice made inside a cached kernel
would be served stale from numba's cache: each is its own cached kernel. The vnni ones are compiled per weight format
(specialise.py), so a Q8_0 file's first run compiles only Q8_0's tiles."""

from __future__ import annotations

import os
from typing import NamedTuple

import numba
import numpy as np
from numba import prange

from ..formats import Q4_0, Q4_K, Q5_K, Q6_K, Q8_0
from . import cpu
from ._bits import FASTMATH, copy_row, isa_kernels, kernel
from .simd_i8 import (
    N_TOK,
    ROWS,
    digits_i8,
    gemm_avx2_1_32_0,
    gemm_avx2_1_32_1,
    gemm_avx2_2_32_0,
    gemm_avx2_2_32_1,
    gemm_generic_1_16_0,
    gemm_generic_1_32_0,
    gemm_generic_1_32_1,
    gemm_generic_2_16_0,
    gemm_generic_2_32_0,
    gemm_generic_2_32_1,
    gemm_vnni_1_16_0,
    gemm_vnni_1_32_0,
    gemm_vnni_1_32_1,
    gemm_vnni_2_16_0,
    gemm_vnni_2_32_0,
    gemm_vnni_2_32_1,
    q4_0_tile,
    q4_k_tile,
    q5_k_tile,
    q6_k_tile,
    q8_0_tile,
)

CODES = (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)  # format codes (streamer.formats) the int8 path serves
# AVX2's tile product (simd_i8._gemm_avx2_intrinsic) sums vpmaddubsw's int16 pairs over a group: exact for
# 4-bit codes only; Q8_0's 8-bit codes would saturate them, Q5_K's and Q6_K's after a few steps
AVX2_CODES = (Q4_0, Q4_K)
# Activation levels per number of int8 digits: 127, or 127 * 256 + 127 (hi stays within int8).
LEVELS = {1: 127, 2: 127 * 256 + 127}


def group_of(fmt: int) -> int:
    return 16 if fmt == Q6_K else 32


@kernel(fastmath=FASTMATH, inline="always")
def _group(fmt):
    return 16 if fmt == Q6_K else 32


@kernel(fastmath=FASTMATH, inline="always")
def _offset(fmt):
    """The weight code offset: w = d * (u - OFF) (- min)."""
    if fmt == Q8_0:
        return 128
    if fmt == Q4_0:
        return 8
    if fmt == Q6_K:
        return 32
    return 0


@kernel(parallel=True, fastmath=FASTMATH)
def quantize_act(X, group, off, digits, xq, dx, xs, xc):
    """Per row i and group g of X: q = rint(x / dx) in [-L, L], dx = max|x| / L (L = LEVELS[digits]), xs = sum
    of x (f32; with one digit, of the rounded x: float(sum q) * dx, for the K-quant mins as ggml's bsums), xc =
    -off * sum(q) (the int32 correction of the weight offset). With 2 digits, q = 256 hi + lo
    (hi, lo int8) is stored per 4 elements as their 4 hi bytes, then their 4 lo bytes."""
    levels = np.float32(127 * 256 + 127) if digits == 2 else np.float32(127)
    m, K = X.shape
    ng = K // group
    if digits == 2 and group == 32:  # the common case, vectorized (simd_i8.digits_i8: the same q, dx and xc)
        for i in prange(m):
            for g in range(ng):
                digits_i8(X[i], xq[i], dx[i], xs[i], xc[i], g, off)
        return
    for i in prange(m):
        for g in range(ng):
            k0 = g * group
            amax = np.float32(0)
            for k in range(k0, k0 + group):
                amax = max(amax, abs(X[i, k]))
            dx[i, g] = amax / levels
            inv = levels / amax if amax > 0 else np.float32(0)
            s = 0
            f = np.float32(0)
            for k in range(k0, k0 + group):
                q = np.int32(np.rint(X[i, k] * inv))
                if digits == 2:
                    lo = ((q + 128) & 255) - 128
                    at = 2 * k - (k & 3)  # chunk k >> 2 starts at byte 8 * (k >> 2)
                    xq[i, at] = (q - lo) >> 8
                    xq[i, at + 4] = lo
                else:
                    xq[i, k] = q
                s += q
                f += X[i, k]
            xs[i, g] = f if digits == 2 else np.float32(s) * dx[i, g]
            xc[i, g] = -off * s


@kernel(fastmath=FASTMATH, inline="always")
def _decode(fmt, w, r0, last, tile, sc, mn, K):
    if fmt == Q4_K:
        q4_k_tile(w, r0, last, tile, sc, mn, K >> 8)
    elif fmt == Q6_K:
        q6_k_tile(w, r0, last, tile, sc, mn, K >> 8)
    elif fmt == Q5_K:
        q5_k_tile(w, r0, last, tile, sc, mn, K >> 8)
    elif fmt == Q8_0:
        q8_0_tile(w, r0, last, tile, sc, mn, K >> 5)
    else:  # Q4_0
        q4_0_tile(w, r0, last, tile, sc, mn, K >> 5)


@kernel(fastmath=FASTMATH, inline="always")
def _gemm_vnni(fmt, digits, tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld):
    if digits == 2:
        if fmt == Q4_K or fmt == Q5_K:
            gemm_vnni_2_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
        elif fmt == Q6_K:
            gemm_vnni_2_16_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
        else:
            gemm_vnni_2_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    elif fmt == Q4_K or fmt == Q5_K:
        gemm_vnni_1_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    elif fmt == Q6_K:
        gemm_vnni_1_16_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    else:
        gemm_vnni_1_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)


@kernel(fastmath=FASTMATH, inline="always")
def _gemm_avx2(fmt, digits, tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld):
    if digits == 2:
        if fmt == Q4_K:
            gemm_avx2_2_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
        else:  # Q4_0
            gemm_avx2_2_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    elif fmt == Q4_K:
        gemm_avx2_1_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    else:
        gemm_avx2_1_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)


@kernel(fastmath=FASTMATH, inline="always")
def _gemm_generic(fmt, digits, tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld):
    if digits == 2:
        if fmt == Q4_K or fmt == Q5_K:
            gemm_generic_2_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
        elif fmt == Q6_K:
            gemm_generic_2_16_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
        else:
            gemm_generic_2_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    elif fmt == Q4_K or fmt == Q5_K:
        gemm_generic_1_32_1(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    elif fmt == Q6_K:
        gemm_generic_1_16_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)
    else:
        gemm_generic_1_32_0(tile, sc, mn, xq, dx, xs, xc, t0, dst, doff, ld)


def _matmul_source(isa):
    def i8_matmul(fmt, digits, w, X, out, act, scratch):
        """out = X . w^T with int8 activations (vpdpbusd, or the portable simd_i8._dp_generic). act (xq, dx, xs,
        xc): xq int8 [m, K], dx/xs f32 and xc int32 [m, K/group], X quantized into them here; scratch (tiles,
        scs, mns, obuf) per thread: tiles [T, 32*K] u8, scs/mns [T, 2*K] f32, obuf [T, N_TOK, 32] f32. Plain
        tuples, as decode.py's blocks take theirs."""
        xq, dx, xs, xc = act
        tiles, scs, mns, obuf = scratch
        m, K = X.shape
        n_out = w.shape[0]
        # the group and offset as plain ints: in a specialised kernel they are constants, which would type (and
        # compile) quantize_act apart for each format instead of sharing int8.quantize's version
        quantize_act(X, np.int64(_group(fmt)), np.int64(_offset(fmt)), digits, xq, dx, xs, xc)
        for t in prange((n_out + ROWS - 1) // ROWS):
            tid = numba.get_thread_id()
            tile, sc, mn, ob = tiles[tid], scs[tid], mns[tid], obuf[tid]
            r0 = t * ROWS
            _decode(fmt, w, r0, n_out - 1, tile, sc, mn, K)
            nr = min(ROWS, n_out - r0)
            for i in range(0, m, N_TOK):  # xq and the rest have zero rows up to a multiple of N_TOK
                full = nr == ROWS and i + N_TOK <= m  # else into ob, then the rows and columns that exist
                d, doff, ld = (out, i * n_out + r0, n_out) if full else (ob, 0, ROWS)
                if isa == "vnni":
                    _gemm_vnni(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i, d, doff, ld)
                elif isa == "avx2":
                    _gemm_avx2(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i, d, doff, ld)
                else:
                    _gemm_generic(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i, d, doff, ld)
                if not full:
                    for a in range(min(N_TOK, m - i)):
                        for j in range(nr):
                            out[i + a, r0 + j] = ob[a, j]

    return i8_matmul


@kernel(fastmath=FASTMATH, inline="always")
def _item(q, g, nt):
    """Work item q of a grouped matmul -> (part j, expert i, row tile t), items in that order."""
    j = q // (g * nt)
    rest = q - j * g * nt
    i = rest // nt
    return j, i, rest - i * nt


@kernel(fastmath=FASTMATH, inline="always")
def _weights(w, off, n_out, row_bytes):
    return w[off : off + n_out * row_bytes].reshape(n_out, row_bytes)


def _grouped_source(isa):
    def i8_grouped(fmt, digits, w, offs, row_bytes, act, rstarts, bounds, out, scratch):
        """For part j and expert i of a group (its out.shape[2] rows at byte offs[j, i] of w) and its activation
        rows rstarts[i]..rstarts[i+1] (quantized, a multiple of N_TOK each): out[j, those rows] = X . W_ji^T, by
        vpdpbusd or the portable dot. Work items (j, i, row tile) in that order; thread slot s computes items
        bounds[s]..bounds[s+1]. act and scratch: as i8_matmul's."""
        xq, dx, xs, xc = act
        tiles, scs, mns, obuf = scratch
        parts, g = offs.shape
        n_out = out.shape[2]
        K = xq.shape[1] // digits
        nt = (n_out + ROWS - 1) // ROWS
        for s in prange(bounds.size - 1):
            tid = numba.get_thread_id()
            tile, sc, mn, ob = tiles[tid], scs[tid], mns[tid], obuf[tid]
            for q in range(bounds[s], bounds[s + 1]):
                j, i, t = _item(q, g, nt)
                a, b = rstarts[i], rstarts[i + 1]
                if b == a:
                    continue
                r0 = t * ROWS
                nr = min(ROWS, n_out - r0)
                _decode(fmt, _weights(w, offs[j, i], n_out, row_bytes), r0, n_out - 1, tile, sc, mn, K)
                dst = out[j]
                for i0 in range(a, b, N_TOK):
                    full = nr == ROWS  # else into ob, then the columns that exist
                    d, doff, ld = (dst, i0 * n_out + r0, n_out) if full else (ob, 0, ROWS)
                    if isa == "vnni":
                        _gemm_vnni(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i0, d, doff, ld)
                    elif isa == "avx2":
                        _gemm_avx2(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i0, d, doff, ld)
                    else:
                        _gemm_generic(fmt, digits, tile, sc, mn, xq, dx, xs, xc, i0, d, doff, ld)
                    if not full:
                        for r in range(N_TOK):
                            for c in range(nr):
                                dst[i0 + r, r0 + c] = ob[r, c]

    return i8_grouped


@kernel(parallel=True)
def gather_act(xq, dx, xs, xc, rows, gq, gdx, gxs, gxc):
    """Row r of gq, gdx, gxs, gxc = row rows[r] of xq, dx, xs, xc; zeros where rows[r] < 0."""
    for r in prange(rows.size):
        t = rows[r]
        copy_row(xq, t, gq, r)
        copy_row(dx, t, gdx, r)
        copy_row(xs, t, gxs, r)
        copy_row(xc, t, gxc, r)


def host_has_vnni() -> bool:
    return cpu.has("avx512vnni", "avx512bw")


def _isa_env() -> str:
    """STREAM_RUN_ISA, normalised ('' when unset)."""
    return os.environ.get("STREAM_RUN_ISA", "").strip().lower()


def host_has_avx2() -> bool:
    return cpu.has("avx2")


def decode_isa() -> str | None:
    """The instruction set of the decode row dots over int8 activation digits (simd_vnni.py, for the formats in
    blocks.DIGIT_CODES): 'vnni' (vpdpbusd) where the CPU has AVX512-VNNI, 'avx2' (vpmaddubsw then vpmaddwd: the
    same exact int32 sums for 4-bit codes) where it has AVX2, else None, the int16 row dots (simd.py). The int16
    path is also what STREAM_RUN_ISA=generic or =f32 asks for."""
    if _isa_env() in ("generic", "f32"):
        return None
    if host_has_vnni():
        return "vnni"
    return "avx2" if host_has_avx2() else None


def host_isa() -> str | None:
    """The int8 kernel QMatrix.matmul uses: 'vnni' where the CPU has AVX512-VNNI and AVX512-BW, else 'avx2' where it
    has AVX2 (for AVX2_CODES' formats; the others keep the f32 tiles), else None (the f32 tiles, which the generic
    kernel does not beat). STREAM_RUN_ISA overrides: 'generic' forces the portable kernel, 'f32' the f32 tiles."""
    env = _isa_env()
    if env == "generic":
        return "generic"
    if env == "f32":
        return None
    if host_has_vnni():
        return "vnni"
    return "avx2" if host_has_avx2() else None


def activation_digits(isa: str | None) -> int:
    """int8 digits per activation: STREAM_RUN_ACT=int8 asks for one (ggml's grid, 257x coarser), =int16 for two
    (int16-fine); by default two where vpdpbusd makes the second nearly free, one where the integer kernels run on
    AVX2, whose vpmaddubsw pays for each digit in full (2026-12-07: a 1.34x faster prefill; held-out perplexity moved
    by at most 0.01%)."""
    env = os.environ.get("STREAM_RUN_ACT", "").strip().lower()
    if env in ("int8", "int16"):
        return 1 if env == "int8" else 2
    return 1 if isa == "avx2" else 2


ISA = host_isa()
DECODE_ISA = decode_isa()
DIGITS = activation_digits(ISA)
XA_MAX = LEVELS[DIGITS]
# vnni's kernels compiled per format (a model's first run compiles its own formats'); the portable ones, which only
# STREAM_RUN_ISA=generic and the tests run, once for every format: per format, the tests, which run each format
# on both, would compile them four times (Q8_0, Q4_K, Q6_K, the rest) instead of once
_OPT = {"parallel": True, "fastmath": FASTMATH}
KERNELS = {
    **isa_kernels(_matmul_source, ("vnni", "avx2"), "i8_matmul", format_args=("fmt",), **_OPT),
    **isa_kernels(_matmul_source, ("generic",), "i8_matmul", **_OPT),
}
GROUPED = {
    **isa_kernels(_grouped_source, ("vnni", "avx2"), "i8_grouped", format_args=("fmt",), **_OPT),
    **isa_kernels(_grouped_source, ("generic",), "i8_grouped", **_OPT),
}


def usable_isas() -> list[str]:
    """The kernels this CPU can run: the generic one always (STREAM_RUN_ISA=generic picks it), avx2 and vnni
    where the CPU has them."""
    return ["generic"] + (["avx2"] if host_has_avx2() else []) + (["vnni"] if host_has_vnni() else [])


def _served_isa(fmt: int, isa: str | None) -> str:
    """isa, or ISA, or the generic kernel; ValueError if that kernel does not serve fmt."""
    isa = isa or ISA or "generic"
    if not serves(fmt, isa):
        raise ValueError(f"the {isa} integer kernel does not serve format {fmt}")
    return isa


def serves(fmt: int, isa: str | None = None) -> bool:
    """Whether isa's integer kernel (default: ISA, the one this process uses) computes format fmt's matmuls."""
    isa = isa or ISA
    return isa is not None and fmt in (AVX2_CODES if isa == "avx2" else CODES)


_tiles: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


def _scratch(n_in: int):
    buf = _tiles.get(n_in)
    if buf is None:
        T = numba.config.NUMBA_NUM_THREADS
        buf = _tiles[n_in] = (
            np.empty((T, ROWS * n_in), np.uint8),
            np.empty((T, ROWS * (n_in // 16)), np.float32),
            np.zeros((T, ROWS * (n_in // 16)), np.float32),
            np.empty((T, N_TOK, ROWS), np.float32),
        )
    return buf


def matmul(
    fmt: int, w: np.ndarray, X: np.ndarray, out: np.ndarray, isa: str | None = None, digits: int | None = None
) -> None:
    """out[m, n_out] = X[m, K] . w^T for a block format in CODES (X, out f32 C-contiguous); isa and digits
    default to ISA and DIGITS. ValueError if isa's kernel does not serve the format (serves)."""
    isa = _served_isa(fmt, isa)
    digits = digits or DIGITS
    m, K = X.shape
    ng = K // group_of(fmt)
    mp = -(-m // N_TOK) * N_TOK  # the kernel reads whole blocks of N_TOK tokens: zero rows past m
    xq = np.empty((mp, digits * K), np.int8)
    dx, xs, xc = np.empty((mp, ng), np.float32), np.empty((mp, ng), np.float32), np.empty((mp, ng), np.int32)
    for a in (xq, dx, xs, xc):
        a[m:] = 0
    KERNELS[isa](fmt, digits, w, X, out, (xq, dx, xs, xc), tuple(_scratch(K)))


class Act(NamedTuple):
    """Activation rows quantized for one format's kernel (quantize_act's outputs)."""

    xq: np.ndarray  # int8 [rows, digits * K]
    dx: np.ndarray  # f32 [rows, K / group]
    xs: np.ndarray  # f32
    xc: np.ndarray  # int32


def quantize(fmt: int, X: np.ndarray, digits: int | None = None) -> Act:
    """X's rows (f32, C-contiguous) quantized as matmul does, plus zero rows up to a multiple of N_TOK."""
    digits = digits or DIGITS
    m, K = X.shape
    ng = K // group_of(fmt)
    mp = -(-m // N_TOK) * N_TOK
    act = Act(np.empty((mp, digits * K), np.int8), *(np.empty((mp, ng), t) for t in (np.float32, np.float32, np.int32)))
    for a in act:
        a[m:] = 0
    quantize_act(X, group_of(fmt), _offset_of(fmt), digits, *act)
    return act


def _offset_of(fmt: int) -> int:
    return {Q8_0: 128, Q4_0: 8, Q6_K: 32}.get(fmt, 0)


def gather(act: Act, rows: np.ndarray) -> Act:
    """The rows `rows` of act (int64; -1: a zero row), in one parallel copy."""
    out = Act(*(np.empty((len(rows),) + a.shape[1:], a.dtype) for a in act))
    gather_act(*act, rows, *out)
    return out


# Cost of unpacking one tile, in units of one N_TOK-token block of its product, for splitting the work items
# between threads (Q4_K, vpdpbusd: unpacking 2.4-10 us, from cache or RAM, against 2.6-2.8 us a block).
DECODE_BLOCKS = 2.5


def grouped_matmul(
    fmt: int,
    w: np.ndarray,
    offs: np.ndarray,
    row_bytes: int,
    act: Act,
    rstarts: np.ndarray,
    out: np.ndarray,
    isa: str | None = None,
    digits: int | None = None,
) -> None:
    """Many experts' matmuls in one parallel call: for part j and expert i (n_out = out.shape[2] rows of
    row_bytes at byte offs[j, i] of the flat uint8 w), out[j, rstarts[i]:rstarts[i+1]] = the activation rows
    rstarts[i]..rstarts[i+1] of act (see quantize, gather; each expert's a multiple of N_TOK) . W_ji^T.
    Each row is what matmul gives for the same weights and activation row, bit for bit. The work items (j, i,
    tile of ROWS rows) are split between the threads by their cost (a tile's unpacking plus its token blocks).
    ValueError as matmul's."""
    isa = _served_isa(fmt, isa)
    digits = digits or DIGITS
    parts, g = offs.shape
    n_out, K = out.shape[2], act.xq.shape[1] // digits
    nt = -(-n_out // ROWS)
    blocks = np.diff(rstarts) // N_TOK
    cost = np.where(blocks > 0, blocks + DECODE_BLOCKS, 0.0)
    cum = np.cumsum(np.broadcast_to(np.repeat(cost, nt), (parts, g * nt)).reshape(-1))
    T = numba.get_num_threads()
    bounds = np.searchsorted(cum, cum[-1] * np.arange(T + 1) / T, side="right") if len(cum) else np.zeros(T + 1)
    bounds = bounds.astype(np.int64)
    bounds[0], bounds[-1] = 0, len(cum)
    GROUPED[isa](fmt, digits, w, offs, row_bytes, tuple(act), rstarts, bounds, out, tuple(_scratch(K)))
