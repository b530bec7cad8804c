"""QMatrix: one 2-D GGUF weight over a zero-copy view, bound once to its format's kernels."""

import os
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np
import psutil
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ..errors import StreamerError
from ..formats import FORMATS, NAMES
from . import blocks, floats, int8
from .gemm import TILE


class Kernels(NamedTuple):
    matvec: Callable  # (fmt, w, x, out, xq, aux) -> None; xq blocks.act_buffer (int16[n_in] or int8[2 n_in]),
    # aux f32 scratch (blocks.prepare)
    matmul: Callable  # (fmt, w, X, out, scratch) -> None; scratch is [threads, TILE, n_in] f32
    rows: Callable  # (fmt, w, ids, out) -> None
    view: type  # dtype the kernels see the data as
    act_group: int  # matvec quantizes x to int16 per this many elements (0: x used as f32)
    fmt: int  # the format code the kernels are called with (they serve several formats, each compiled apart)


_FAMILIES = {  # streamer.formats' kernel families: (matvec, matmul, rows, view)
    "f32": (floats.f32_matvec, floats.f32_matmul, floats.f32_rows, np.float32),
    "half": (floats.half_matvec, floats.half_matmul, floats.half_rows, np.uint16),
    "block": (blocks.block_matvec, blocks.block_matmul, blocks.block_rows, np.uint8),
}
SUPPORTED: dict[T, Kernels] = {t: Kernels(*_FAMILIES[f.family], f.act_group, f.code) for t, f in FORMATS.items()}
# Formats whose matmul (m > 1) runs int8.py's integer kernel instead of the f32 tiles.
INT8: frozenset[T] = frozenset(t for t, f in FORMATS.items() if f.family == "block" and f.code in int8.CODES)

# Scratch shared by all matrices (only the main thread runs kernels), keyed by n_in.
_act: dict[tuple[int, bool, bool], tuple[np.ndarray, np.ndarray]] = {}
_tiles: dict[int, np.ndarray] = {}


def _act_scratch(n_in: int, block: bool) -> tuple[np.ndarray, np.ndarray]:
    """The quantized x (blocks.act_buffer for the block formats, else int16, unused) and f32 aux (scales per
    32/256, then f32 sums per 32 or 16: blocks.prepare) for one matvec of n_in."""
    key = (n_in, block, blocks.DIGITS)
    buf = _act.get(key)
    if buf is None:
        xq = blocks.act_buffer(n_in) if block else np.empty(n_in, np.int16)
        buf = _act[key] = (xq, np.empty(3 * (n_in // 32) + 1, np.float32))
    return buf


def _tile_scratch(n_in: int) -> np.ndarray:
    buf = _tiles.get(n_in)
    if buf is None:
        buf = _tiles[n_in] = np.empty((numba.config.NUMBA_NUM_THREADS, TILE, n_in), np.float32)
    return buf


class QMatrix:
    """A 2-D weight of n_out rows x n_in columns in one GGML format, over a zero-copy view."""

    __slots__ = (
        "name",
        "qtype",
        "n_out",
        "n_in",
        "nbytes",
        "_w",
        "_k",
        "_fmt",
        "_mv",
        "_mm",
        "_rw",
        "_xq",
        "_aux",
        "_i8",
    )

    def __init__(self, data: np.ndarray, qtype: T, n_in: int, name: str = ""):
        try:
            qtype = T(qtype)
        except ValueError:
            raise StreamerError(f"tensor {name!r} has unknown GGML type {qtype!r}") from None
        k = SUPPORTED.get(qtype)
        if k is None:
            tname = qtype.name
            raise StreamerError(
                f"tensor {name!r} has type {tname}, which stream-run does not support (supported: {NAMES})"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        if data.ndim != 2 or n_in % block or data.nbytes != data.shape[0] * (n_in // block) * type_size:
            raise StreamerError(
                f"tensor {name!r}: {qtype.name} data of shape {data.shape} and dtype {data.dtype} "
                f"does not hold rows of {n_in} elements"
            )
        if not data.flags.c_contiguous:
            raise StreamerError(f"tensor {name!r}: weight view is not contiguous")
        w = data.view(k.view)  # O(1): same bytes, the element type the kernels index by
        w.flags.writeable = False  # kernels see one (read-only) array type, as from the mmap
        self.name, self.qtype, self.n_in, self._w, self._k = name, qtype, n_in, w, k
        self.n_out = data.shape[0]
        self.nbytes = data.nbytes
        self._fmt = k.fmt  # the kernels compiled for this format only (specialise.py)
        self._mv, self._mm, self._rw = (f.specialise(k.fmt) for f in (k.matvec, k.matmul, k.rows))
        self._xq, self._aux = _act_scratch(n_in, k.matvec is blocks.block_matvec)
        self._i8 = qtype in INT8 and int8.serves(k.fmt)

    @property
    def block(self) -> tuple[int, np.ndarray] | None:
        """(format code, uint8 rows) for kernels that take blocks.dot's arguments (kernels/decode.py), None if
        the format is not block-quantized."""
        return (self._fmt, self._w) if self._k.matvec is blocks.block_matvec else None

    def first_rows(self, n: int) -> "QMatrix":
        """A QMatrix over the first n rows (same bytes, same array type: used to warm kernels up cheaply)."""
        return QMatrix(self._w[:n], self.qtype, self.n_in, self.name)

    def __repr__(self) -> str:
        return f"QMatrix({self.name!r}, {self.qtype.name}, {self.n_out}x{self.n_in})"

    def matvec(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x f32[n_in] -> f32[n_out] (decode)."""
        if x.shape != (self.n_in,):
            raise ValueError(f"{self.name}: x has shape {x.shape}, expected ({self.n_in},)")
        if out is None:
            out = np.empty(self.n_out, np.float32)
        elif out.shape != (self.n_out,):  # the kernels do not bounds-check
            raise ValueError(f"{self.name}: out has shape {out.shape}, expected ({self.n_out},)")
        self._mv(self._fmt, self._w, x, out, self._xq, self._aux)
        return out

    def matmul(self, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """X f32[m, n_in] -> f32[m, n_out] (prefill)."""
        X = np.ascontiguousarray(X, np.float32)
        m = X.shape[0]
        if X.ndim != 2 or X.shape[1] != self.n_in:
            raise ValueError(f"{self.name}: X has shape {X.shape}, expected (m, {self.n_in})")
        if out is None:
            out = np.empty((m, self.n_out), np.float32)
        elif out.shape != (m, self.n_out) or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out has shape {out.shape}, expected contiguous ({m}, {self.n_out})")
        if m == 1:
            self._mv(self._fmt, self._w, X[0], out[0], self._xq, self._aux)
        elif self._i8:
            int8.matmul(self._fmt, self._w, X, out)
        else:
            self._mm(self._fmt, self._w, X, out, _tile_scratch(self.n_in))
        return out

    def rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Dequantize only rows ids -> f32[len(ids), n_in] (embedding gather)."""
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_out):
            raise IndexError(f"{self.name}: row ids out of range [0, {self.n_out})")
        if out is None:
            out = np.empty((ids.size, self.n_in), np.float32)
        elif out.shape != (ids.size, self.n_in) or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out has shape {out.shape}, expected contiguous ({ids.size}, {self.n_in})")
        self._rw(self._fmt, self._w, ids, out)
        return out


def set_threads(n: int | None = None) -> None:
    """Threads the parallel kernels use (numba.set_num_threads; per calling thread). None: llama.cpp's default,
    the physical cores (not more than numba's pool)."""
    top = numba.config.NUMBA_NUM_THREADS
    if n is None:
        n = max(1, min(psutil.cpu_count(logical=False) or os.cpu_count() or 1, top))
    if not 1 <= n <= top:
        raise StreamerError(f"threads={n} is out of range (1..{top} on this machine)")
    numba.set_num_threads(n)
