"""Block-quantized weights: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 (32-element blocks) and Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (256-element super-blocks); the low-bit layouts are
drawn in simd_lowbit.py and simd_iq.py.

Mirrors ggml's block_q8_0 {ggml_half d; int8_t qs[32]} (34 bytes), block_q4_0 {ggml_half d; uint8_t qs[16]} (18 bytes;
element l is the low nibble of qs[l], element l+16 the high nibble, value d * (q - 8)), block_q4_K {d, dmin, scales[12],
qs[128]} (144 bytes), block_q5_K {d, dmin, scales[12], qh[32], qs[128]} (176 bytes) and block_q6_K {ql[128], qh[64],
int8 scales[16], d} (210 bytes). Rows are read straight from the GGUF bytes: matvec runs simd's vector row dot on x
quantized to int16 per 32 (Q8_0, Q4_0) or per 256 (K-quants, whose mins use exact f32 sums of x per 32) or, where the
CPU has AVX512-VNNI or AVX2, Q4_K's digit row dot (simd_vnni.py) on int8 digits (selected by the activation buffer's
dtype: act_buffer, prepare); matmul and rows dequantize exactly (simd's *_deq) into f32.

One kernel serves every format: it takes the format's code (streamer.formats) and branches on it once per row; the
per-format work is simd's. The multi-expert kernels (experts.py) share prepare and dot."""

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from ..formats import (
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    SUPER_BLOCKS,
)
from ._bits import FASTMATH, kernel
from .activations import group_sums, quantize_groups
from .gemm import gemm_tile
from .int8 import DECODE_ISA, DIGITS as INT8_DIGITS
from .simd import (
    q4_0_deq,
    q4_0_dot,
    q4_k_deq,
    q4_k_dot,
    q4_k_dot2,
    q5_k_deq,
    q5_k_dot,
    q6_k_deq,
    q6_k_dot,
    q8_0_deq,
    q8_0_dot,
)
from .simd_avx2 import act_digits, q4_k_digit_dot, q4_k_digit_dot2, q4_k_digit_dot2x2, q4_k_digit_dot2x3
from .simd_iq import (
    iq1_m_deq,
    iq1_m_dot,
    iq1_s_deq,
    iq1_s_dot,
    iq2_s_deq,
    iq2_s_dot,
    iq2_xs_deq,
    iq2_xs_dot,
    iq2_xxs_deq,
    iq2_xxs_dot,
    iq3_s_deq,
    iq3_s_dot,
    iq3_xxs_deq,
    iq3_xxs_dot,
)
from .simd_lowbit import (
    iq4_nl_deq,
    iq4_nl_dot,
    iq4_xs_deq,
    iq4_xs_dot,
    mxfp4_deq,
    mxfp4_dot,
    q2_k_deq,
    q2_k_dot,
    q3_k_deq,
    q3_k_dot,
    q4_1_deq,
    q4_1_dot,
    q5_0_deq,
    q5_0_dot,
    q5_1_deq,
    q5_1_dot,
)
from .specialise import format_kernel

PF = 8192  # prefetch distance in bytes ahead of the block being read: rows are read front to back (8 KiB: the
# Q4_K digit row dot read a 184 MB matrix from RAM 7% faster on one thread than with 4 KiB, as fast as from L3)


# The helpers below are inlined as numba IR (inline="always") into prepare's, dot's and dot2's implementations,
# which pass them either the format code argument (one compiled version for every format) or, when the kernel is
# specialised to a format (specialise.py: the code typed as a literal), that code as a constant: numba's
# dead-branch pruning then keeps only that format's branch.
_HELPER = {"fastmath": FASTMATH, "inline": "always"}


@kernel(**_HELPER)
def prepare_i16(fmt, x, xq, aux):
    """Quantize x for the format's row dot: int16 per 32 or 256 elements, scales in aux[:n/32] (first n/256
    used for super-blocks) and, for super-blocks and the 32-element formats with mins (Q4_1, Q5_1), f32 sums
    per 32 in aux[n/32:] (per 16 for Q2_K, whose sub-blocks are 16). aux holds 3n/32 + 1. Returns (dx, xs)
    views of aux."""
    ng = x.size >> 5
    if fmt >= SUPER_BLOCKS:
        quantize_groups(x, xq, aux[:ng], 256)
        if fmt == Q2_K:
            group_sums(x, aux[ng : 3 * ng], 16)
        else:
            group_sums(x, aux[ng : 2 * ng], 32)
    else:
        quantize_groups(x, xq, aux[:ng], 32)
        if fmt == Q4_1 or fmt == Q5_1:
            group_sums(x, aux[ng : 2 * ng], 32)
    return aux[:ng], aux[ng : 3 * ng]


@kernel(**_HELPER)
def dot_i16(fmt, w, off, xq, dx, xs, n_in):
    """The row starting at byte `off` of w, dot the prepared x of n_in elements (the common formats first)."""
    if fmt == Q4_K:
        return q4_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == Q6_K:
        return q6_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == Q5_K:
        return q5_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == Q8_0:
        return q8_0_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    if fmt == Q4_0:
        return q4_0_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    if fmt == Q2_K:
        return q2_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == Q3_K:
        return q3_k_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ4_XS:
        return iq4_xs_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ4_NL:
        return iq4_nl_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    if fmt == Q4_1:
        return q4_1_dot(w, off, xq, dx, xs, n_in >> 5, PF)
    if fmt == Q5_0:
        return q5_0_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    if fmt == Q5_1:
        return q5_1_dot(w, off, xq, dx, xs, n_in >> 5, PF)
    if fmt == MXFP4:
        return mxfp4_dot(w, off, xq, dx, dx, n_in >> 5, PF)
    if fmt == IQ2_XXS:
        return iq2_xxs_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ2_XS:
        return iq2_xs_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ2_S:
        return iq2_s_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ3_XXS:
        return iq3_xxs_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ3_S:
        return iq3_s_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    if fmt == IQ1_S:
        return iq1_s_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    return iq1_m_dot(w, off, xq, dx, xs, n_in >> 8, PF)  # IQ1_M


# The formats whose decode row dot has a version over int8 activation digits (simd_vnni.py; simd_avx2.py on AVX2).
DIGIT_CODES = (Q4_K,)
# Decode with int8 digits where the CPU has AVX512-VNNI or AVX2 (int8.decode_isa: STREAM_RUN_ISA=generic or f32 keep
# the int16 path). Chosen here, in Python: act_buffer's dtype picks the compiled kernel version (see prepare).
DIGITS = DECODE_ISA is not None
# ... and one digit per element instead of two where int8.DIGITS == 1 (AVX2, or STREAM_RUN_ACT=int8): the
# buffer's bytes typed uint8. ggml's q8 grid (127 levels, here per 32 elements): faster, 257x coarser.
ONE_DIGIT = DIGITS and INT8_DIGITS == 1


def act_buffer(n_in: int, *lead: int) -> np.ndarray:
    """The activation buffer the kernels fill with prepare, shape (*lead, n_in): int16, or with DIGITS its bytes
    as int8 (*lead, 2 n_in), which makes the kernels use the vpdpbusd row dots. 64-byte aligned (the digit
    loads are whole cache lines: 4% faster than lines split)."""
    size = int(np.prod(lead, dtype=np.int64)) * n_in
    raw = np.empty(size + 32, np.int16)
    at = (-raw.ctypes.data % 64) // 2
    xq = raw[at : at + size].reshape(*lead, n_in)
    return xq.view(np.uint8 if ONE_DIGIT else np.int8) if DIGITS else xq


def _is_digits(xq):
    return isinstance(xq, types.Array) and xq.dtype in (types.int8, types.uint8)


def _code(fmt):
    """The format code if fmt is typed as a literal (a kernel specialised to it: specialise.py), else None."""
    return fmt.literal_value if isinstance(fmt, types.IntegerLiteral) else None


_OV = {"fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


def prepare(fmt, x, xq, aux):
    """Quantize x for the format's row dot (kernels only). xq is the activation buffer: int16 [n] (prepare_i16,
    simd.py's dots) or, where the CPU has AVX512-VNNI or AVX2 (DIGITS), the same bytes as int8 [2n]: then the formats
    in DIGIT_CODES get int8 digits (simd_avx2.act_digits: scales in aux[:n/32], f32 sums per 32 after them) for
    simd_avx2.q4_k_digit_dot, the others the int16 path in those bytes. Chosen when the kernel is compiled, by xq's
    dtype, never at run time. Returns (dx, xs) views of aux."""
    raise NotImplementedError("blocks.prepare runs inside numba kernels only")


@kernel(**_HELPER)
def _prepare8(fmt, x, xq, aux):
    ng = x.size >> 5
    if fmt == Q4_K:
        for b in range(ng >> 3):  # vector code (simd_avx2.act_digits: one or two digits by xq's type), x C-contiguous
            act_digits(x, xq, aux[:ng], aux[ng : 2 * ng], b)
        return aux[:ng], aux[ng : 3 * ng]
    return prepare_i16(fmt, x, xq.view(np.int16), aux)


@kernel(**_HELPER)
def _prepare8a(fmt, x, xq, aux):  # x of any layout: a contiguous copy, so the digits are the same bits as impl8's
    ng = x.size >> 5
    if fmt == Q4_K:
        xc = np.ascontiguousarray(x)
        for b in range(ng >> 3):
            act_digits(xc, xq, aux[:ng], aux[ng : 2 * ng], b)
        return aux[:ng], aux[ng : 3 * ng]
    return prepare_i16(fmt, x, xq.view(np.int16), aux)


@overload(prepare, inline="always", jit_options=_OV, prefer_literal=True)
def _prepare(fmt, x, xq, aux):
    F = _code(fmt)
    if not _is_digits(xq):
        fn = prepare_i16
    elif isinstance(x, types.Array) and x.layout == "C":
        fn = _prepare8
    else:
        fn = _prepare8a
    if F is None:

        def impl(fmt, x, xq, aux):
            return fn(fmt, x, xq, aux)

        return impl

    def impl_f(fmt, x, xq, aux):  # F: a constant, the other formats' branches pruned
        return fn(F, x, xq, aux)

    return impl_f


def dot(fmt, w, off, xq, dx, xs, n_in):
    """The row starting at byte `off` of w, dot the prepared x of n_in elements (kernels only; see prepare)."""
    raise NotImplementedError("blocks.dot runs inside numba kernels only")


@kernel(**_HELPER)
def _dot8(fmt, w, off, xq, dx, xs, n_in):
    if fmt == Q4_K:
        return q4_k_digit_dot(w, off, xq, dx, xs, n_in >> 8, PF)
    return dot_i16(fmt, w, off, xq.view(np.int16), dx, xs, n_in)


@overload(dot, inline="always", jit_options=_OV, prefer_literal=True)
def _dot(fmt, w, off, xq, dx, xs, n_in):
    F = _code(fmt)
    fn = _dot8 if _is_digits(xq) else dot_i16  # _dot8: one or two digits by xq's dtype
    if F is None:

        def impl(fmt, w, off, xq, dx, xs, n_in):
            return fn(fmt, w, off, xq, dx, xs, n_in)

        return impl

    def impl_f(fmt, w, off, xq, dx, xs, n_in):
        return fn(F, w, off, xq, dx, xs, n_in)

    return impl_f


@kernel(**_HELPER)
def _rows2(fmt, w, off, stride, xq, dx, xs, n_in):
    """dot_i16 of the rows at off and off + stride, from ONE inlined copy of dot_i16 (a loop, not two calls):
    its body holds every format's row dot (unless the format is a constant), and a second copy in every kernel
    that pairs rows cost the first run ~30 s more compiling. Each value is dot_i16's for that row."""
    a = b = np.float32(0.0)
    for k in range(2):
        v = dot_i16(fmt, w, off + k * stride, xq, dx, xs, n_in)
        if k == 0:
            a = v
        else:
            b = v
    return a, b


def dot2(fmt, w, off, stride, xq, dx, xs, n_in):
    """(dot of the row at byte off, dot of the row at off + stride) with the prepared x (kernels only). Q4_K
    takes the two-row intrinsics (simd's n_rows=2: one loop, x loads shared): each value agrees with dot's for
    that row to float32 rounding (not always bit for bit), so every kernel pairs the rows of a matrix the same way,
    (0, 1), (2, 3), ..., the last alone if their number is odd, whatever else it computes: streamed and resident
    decode then get the same bits. Other formats: two dot calls."""
    raise NotImplementedError("blocks.dot2 runs inside numba kernels only")


@kernel(**_HELPER)
def _dot2_16(fmt, w, off, stride, xq, dx, xs, n_in):
    if fmt == Q4_K:
        return q4_k_dot2(w, off, stride, xq, dx, xs, n_in >> 8, PF)
    return _rows2(fmt, w, off, stride, xq, dx, xs, n_in)


@kernel(**_HELPER)
def _dot2_8(fmt, w, off, stride, xq, dx, xs, n_in):
    if fmt == Q4_K:
        return q4_k_digit_dot2(w, off, stride, xq, dx, xs, n_in >> 8, PF)
    return _rows2(fmt, w, off, stride, xq.view(np.int16), dx, xs, n_in)


@overload(dot2, inline="always", jit_options=_OV, prefer_literal=True)
def _dot2(fmt, w, off, stride, xq, dx, xs, n_in):
    F = _code(fmt)
    fn = _dot2_8 if _is_digits(xq) else _dot2_16
    if F is None:

        def impl(fmt, w, off, stride, xq, dx, xs, n_in):
            return fn(fmt, w, off, stride, xq, dx, xs, n_in)

        return impl

    def impl_f(fmt, w, off, stride, xq, dx, xs, n_in):
        return fn(F, w, off, stride, xq, dx, xs, n_in)

    return impl_f


def dot2_tokens(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
    """The rows at byte off and off + stride of w, each dotted with the tokens toks[p], toks[p + 1] (and toks[p + 2]
    if n >= 3) prepared in xq[t] and aux[t] (grouped.prepare_rows' layout), into out[p + j, r] and out[p + j,
    r + 1]: the rows read and unpacked once for the 2 or 3 tokens. Returns how many tokens it took: 0 (the caller
    then calls dot2 per token) where n < 2 or the format has no such dot (Q4_K over digits only). Each value is
    dot2's for that token, bit for bit: the same operations per token (simd.SplitBody)."""
    raise NotImplementedError("blocks.dot2_tokens runs inside numba kernels only")


@kernel(**_HELPER)
def _dot2_tokens8(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
    if fmt != Q4_K or n < 2:
        return 0
    nb = (xq.shape[1] * xq.itemsize) >> 9  # xq: 2 n_in bytes whatever the digits (act_buffer)
    ng = nb << 3
    t0, t1 = toks[p], toks[p + 1]
    if n == 2:
        out[p, r], out[p + 1, r], out[p, r + 1], out[p + 1, r + 1] = q4_k_digit_dot2x2(
            w,
            off,
            stride,
            xq[t0],
            aux[t0, :ng],
            aux[t0, ng : 3 * ng],
            xq[t1],
            aux[t1, :ng],
            aux[t1, ng : 3 * ng],
            nb,
            PF,
        )
        return 2
    t2 = toks[p + 2]
    a0, a1, a2, b0, b1, b2 = q4_k_digit_dot2x3(
        w, off, stride, xq[t0], aux[t0, :ng], aux[t0, ng : 3 * ng], xq[t1], aux[t1, :ng], aux[t1, ng : 3 * ng],
        xq[t2], aux[t2, :ng], aux[t2, ng : 3 * ng], nb, PF,
    )  # fmt: skip
    out[p, r], out[p + 1, r], out[p + 2, r] = a0, a1, a2
    out[p, r + 1], out[p + 1, r + 1], out[p + 2, r + 1] = b0, b1, b2
    return 3


@kernel(**_HELPER)
def _dot2_tokens_none(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
    return 0


@overload(dot2_tokens, inline="always", jit_options=_OV, prefer_literal=True)
def _dot2_tokens(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
    F = _code(fmt)
    fn = _dot2_tokens8 if _is_digits(xq) and F in (None, Q4_K) else _dot2_tokens_none
    if F is None:

        def impl(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
            return fn(fmt, w, off, stride, xq, aux, toks, p, n, out, r)

        return impl

    def impl_f(fmt, w, off, stride, xq, aux, toks, p, n, out, r):
        return fn(F, w, off, stride, xq, aux, toks, p, n, out, r)

    return impl_f


def dot2_pf(fmt, w, off, stride, xq, dx, xs, n_in, pf):
    """dot2, with Q4_K's prefetches `pf` bytes ahead of each block read instead of PF (the same arithmetic, the
    same bits): a caller reading matrices one after another points them into the next matrix near the end of
    one (kernels/experts.py). Other formats: dot2. Its kernels repeat dot2's rather than dot2 calling them with
    PF: that one more inlined layer made a specialised block_matvec compile in 8-11 s instead of 5 (same IR)."""
    raise NotImplementedError("blocks.dot2_pf runs inside numba kernels only")


@kernel(**_HELPER)
def _dot2_8pf(fmt, w, off, stride, xq, dx, xs, n_in, pf):
    if fmt == Q4_K:
        return q4_k_digit_dot2(w, off, stride, xq, dx, xs, n_in >> 8, pf)
    return _rows2(fmt, w, off, stride, xq.view(np.int16), dx, xs, n_in)


@kernel(**_HELPER)
def _dot2_16pf(fmt, w, off, stride, xq, dx, xs, n_in, pf):
    if fmt == Q4_K:
        return q4_k_dot2(w, off, stride, xq, dx, xs, n_in >> 8, pf)
    return _rows2(fmt, w, off, stride, xq, dx, xs, n_in)


@overload(dot2_pf, inline="always", jit_options=_OV, prefer_literal=True)
def _dot2_pf(fmt, w, off, stride, xq, dx, xs, n_in, pf):
    F = _code(fmt)
    fn = _dot2_8pf if _is_digits(xq) else _dot2_16pf
    if F is None:

        def impl(fmt, w, off, stride, xq, dx, xs, n_in, pf):
            return fn(fmt, w, off, stride, xq, dx, xs, n_in, pf)

        return impl

    def impl_f(fmt, w, off, stride, xq, dx, xs, n_in, pf):
        return fn(F, w, off, stride, xq, dx, xs, n_in, pf)

    return impl_f


@kernel(fastmath=FASTMATH, inline="always")
def deq(fmt, w, off, dst, at, n_in):
    """Dequantize the row starting at byte `off` of w into n_in f32 elements of dst (C-contiguous), from flat
    index `at`."""
    if fmt == Q4_K:
        q4_k_deq(w, off, dst, at, n_in >> 8)
    elif fmt == Q6_K:
        q6_k_deq(w, off, dst, at, n_in >> 8)
    elif fmt == Q5_K:
        q5_k_deq(w, off, dst, at, n_in >> 8)
    elif fmt == Q8_0:
        q8_0_deq(w, off, dst, at, n_in >> 5)
    elif fmt == Q4_0:
        q4_0_deq(w, off, dst, at, n_in >> 5)
    elif fmt == Q2_K:
        q2_k_deq(w, off, dst, at, n_in >> 8)
    elif fmt == Q3_K:
        q3_k_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ4_XS:
        iq4_xs_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ4_NL:
        iq4_nl_deq(w, off, dst, at, n_in >> 5)
    elif fmt == Q4_1:
        q4_1_deq(w, off, dst, at, n_in >> 5)
    elif fmt == Q5_0:
        q5_0_deq(w, off, dst, at, n_in >> 5)
    elif fmt == Q5_1:
        q5_1_deq(w, off, dst, at, n_in >> 5)
    elif fmt == MXFP4:
        mxfp4_deq(w, off, dst, at, n_in >> 5)
    elif fmt == IQ2_XXS:
        iq2_xxs_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ2_XS:
        iq2_xs_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ2_S:
        iq2_s_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ3_XXS:
        iq3_xxs_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ3_S:
        iq3_s_deq(w, off, dst, at, n_in >> 8)
    elif fmt == IQ1_S:
        iq1_s_deq(w, off, dst, at, n_in >> 8)
    else:  # IQ1_M
        iq1_m_deq(w, off, dst, at, n_in >> 8)


@format_kernel(parallel=True, fastmath=FASTMATH)
def block_matvec(fmt, w, x, out, xq, aux):
    dx, xs = prepare(fmt, x, xq, aux)
    rb = w.shape[1]
    n = w.shape[0]
    for p in prange((n + 1) >> 1):  # rows in pairs (dot2), the last alone if n is odd
        r = 2 * p
        if r + 1 < n:
            out[r], out[r + 1] = dot2(fmt, w, r * rb, rb, xq, dx, xs, x.size)
        else:
            out[r] = dot(fmt, w, r * rb, xq, dx, xs, x.size)


@format_kernel(parallel=True, fastmath=FASTMATH)
def block_matmul(fmt, w, X, out, scratch):
    n_out, rb = w.shape
    K = X.shape[1]
    tile = scratch.shape[1]  # gemm.TILE rows: the buffer's, not a constant numba's cache could hold stale
    for t in prange((n_out + tile - 1) // tile):
        buf = scratch[numba.get_thread_id()]
        r0 = t * tile
        nr = min(tile, n_out - r0)
        for j in range(nr):
            deq(fmt, w, (r0 + j) * rb, buf, j * K, K)
        gemm_tile(X, buf, 0, nr, out, r0)


@format_kernel()
def block_rows(fmt, w, ids, out):
    K = out.shape[1]
    for i in range(ids.size):
        deq(fmt, w, ids[i] * w.shape[1], out, i * K, K)
