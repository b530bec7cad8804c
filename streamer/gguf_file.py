"""Open a GGUF file: parse the header ourselves over one read-only np.memmap, expose tensors as views.

gguf.GGUFReader builds one numpy object per string of the 151,936-token vocabulary (measured: 6.9 s
and +536 MB RSS on a 17 GB file), so the header is walked with struct here and string arrays are
only located, then decoded when somebody asks for them. Constants and sizes still come from gguf-py.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, Keys

from streamer.errors import StreamerError
from streamer.inram import read_into_memory
from streamer.mapping import madvise, map_files

# GGUFValueType -> (struct code, size) for scalars; 8 = STRING, 9 = ARRAY.
_SCALAR = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_NP = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_MAX_DEPTH = 8  # arrays of arrays: no model uses them, gguf-py reads any depth; deeper is refused, not recursed
_MIN_KV = 8 + 4 + 1  # smallest metadata entry: empty key, value type, a 1-byte value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dimension, type, offset
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


def _show(text: str) -> str:
    """A key or tensor name for a one-line message: control characters escaped, at most 80 characters."""
    text = text if text.isprintable() else repr(text)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(val) -> str:
    """A metadata value for a one-line message."""
    if isinstance(val, (_StringArray, list, np.ndarray)):
        n = val.count if isinstance(val, _StringArray) else len(val)
        kind = "strings" if isinstance(val, _StringArray) else "arrays" if isinstance(val, list) else val.dtype.name
        return f"an array of {n} {kind}"
    if isinstance(val, str):
        return f"the string '{_show(val)}'"
    return repr(val)  # a number or a boolean


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical elements, numpy order (reverse of ggml ne)
    offset: int  # byte offset in GGUFFile.mm (in its shard's file: offset - that shard's base)
    nbytes: int
    shard: int = 0  # which file of a split model holds it (0 for a single file)

    @property
    def type_name(self) -> str:
        return self.qtype.name


class _StringArray:
    """A located, not yet decoded, GGUF string array."""

    __slots__ = ("start", "count")

    def __init__(self, start: int, count: int):
        self.start, self.count = start, count


class _Header:
    """One GGUF file's header, parsed over its bytes at `base` of the shared mapping: metadata fields and tensor
    infos (offsets absolute in the mapping). Errors name this file."""

    def __init__(self, path: str, mm: np.ndarray, base: int, size: int, shard: int = 0):
        self.path, self.mm, self.base, self.size, self.shard = path, mm, base, size, shard
        self._buf = memoryview(mm[base : base + size])
        self.fields: dict[str, object] = {}
        self.types: dict[str, int] = {}  # GGUF value type of each key
        self.tensors: dict[str, TensorInfo] = {}
        self._where = "the header"  # what is being read, for the truncation message
        try:
            self._parse()
        except struct.error:
            raise StreamerError(
                f"{self.path} is truncated: the GGUF header runs past the end of the file (reading {self._where})"
            ) from None
        finally:
            self._buf.release()

    def _parse(self) -> None:
        buf = self._buf
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise StreamerError(f"{self.path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        if version not in (2, 3):
            raise StreamerError(f"{self.path}: GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        for what, n, least in (("tensors", n_tensors, _MIN_TENSOR_INFO), ("metadata keys", n_kv, _MIN_KV)):
            if n * least > self.size:
                raise StreamerError(
                    f"{self.path} is truncated or not a valid GGUF file (its header claims {n} "
                    f"{what}, more than its {self.size} bytes can hold)"
                )
        off = 24
        for i in range(n_kv):
            self._where = f"metadata key #{i}"
            key, off = self._str(off)
            self._where = f"metadata key '{_show(key)}'"
            if key in self.fields:
                raise StreamerError(f"{self.path}: metadata key '{_show(key)}' appears twice")
            (vtype,), off = struct.unpack_from("<I", buf, off), off + 4
            self.types[key] = vtype
            self.fields[key], off = self._value(vtype, off, key)
        infos, names = [], set()
        for i in range(n_tensors):
            self._where = f"tensor info #{i}"
            name, off = self._str(off)
            self._where = f"the info of tensor '{_show(name)}'"
            if name in names:
                raise StreamerError(f"{self.path}: tensor '{_show(name)}' appears twice in the tensor table")
            names.add(name)
            (n_dims,), off = struct.unpack_from("<I", buf, off), off + 4
            if not 1 <= n_dims <= 4:
                raise StreamerError(f"{self.path}: tensor '{_show(name)}' has {n_dims} dimensions (GGUF allows 1 to 4)")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, off)
            off += 8 * n_dims
            ttype, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, ne, ttype, rel))
        align = self.fields.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise StreamerError(f"{self.path}: general.alignment is {_describe(align)}, not a positive power of two")
        data_start = -(-off // align) * align
        for name, ne, ttype, rel in infos:
            if rel % align:
                raise StreamerError(
                    f"{self.path}: tensor '{_show(name)}' has data offset {rel}, "
                    f"not a multiple of the alignment {align}"
                )
            self.tensors[name] = self._tensor_info(name, ne, ttype, data_start + rel)
        self.data_start = data_start

    def _tensor_info(self, name: str, ne: tuple[int, ...], ttype: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise StreamerError(f"tensor '{_show(name)}' has unknown GGML type id {ttype}") from None
        if max(ne) >= 1 << 63:
            raise StreamerError(f"tensor '{_show(name)}' has a dimension of {max(ne)} (at most 2**63-1)")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise StreamerError(
                f"tensor '{_show(name)}' ({qtype.name}): row length {ne[0]} is not a multiple of the block size {block}"
            )
        nbytes = math.prod(ne) // block * type_size
        if offset + nbytes > self.size:
            raise StreamerError(
                f"{self.path} is truncated: tensor '{_show(name)}' ends at byte {offset + nbytes} "
                f"but the file has {self.size} bytes"
            )
        return TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), self.base + offset, nbytes, self.shard)

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, off)
        end = off + 8 + n
        if end > self.size:
            raise struct.error("string past EOF")
        return bytes(self._buf[off + 8 : end]).decode("utf-8", errors="replace"), end

    def _value(self, vtype: int, off: int, key: str, depth: int = 0):
        if vtype in _SCALAR:
            code, size = _SCALAR[vtype]
            return struct.unpack_from("<" + code, self._buf, off)[0], off + size
        if vtype == _STRING:
            return self._str(off)
        if vtype != _ARRAY:
            raise StreamerError(f"{self.path}: metadata key '{_show(key)}' has unknown GGUF value type {vtype}")
        if depth == _MAX_DEPTH:
            raise StreamerError(f"{self.path}: metadata key '{_show(key)}' nests arrays more than {_MAX_DEPTH} deep")
        etype, count = struct.unpack_from("<IQ", self._buf, off)
        off += 12
        least = np.dtype(_NP[etype]).itemsize if etype in _NP else 8 if etype == _STRING else 12
        if count * least > self.size - off:
            raise StreamerError(
                f"{self.path} is truncated or corrupt: metadata key '{_show(key)}' claims {count} "
                f"array elements, more than the rest of the file can hold"
            )
        if etype in _NP:
            dt = np.dtype(_NP[etype])
            return np.frombuffer(self.mm, dtype=dt, count=count, offset=self.base + off), off + count * dt.itemsize
        if etype == _STRING:
            start, unpack = off, struct.Struct("<Q").unpack_from
            for _ in range(count):  # locate only; decoding waits for get_strings()
                off += 8 + unpack(self._buf, off)[0]
                if off > self.size:
                    raise struct.error("string array past EOF")
            return _StringArray(self.base + start, count), off
        if etype == _ARRAY:  # each element is itself an array value: element type, count, elements
            vals = []
            for _ in range(count):
                v, off = self._value(_ARRAY, off, key, depth + 1)
                vals.append(v)
            return vals, off
        raise StreamerError(f"{self.path}: metadata key '{_show(key)}' is an array of unknown GGUF value type {etype}")


@dataclass(frozen=True)
class Shard:
    """One file of a model: where it sits in GGUFFile.mm (base), its size and tensor count."""

    path: str
    base: int
    size: int
    data_start: int  # start of its data section, in the file
    n_tensors: int


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SPLIT_TYPES = {SPLIT_NO: (2, "u16"), SPLIT_COUNT: (2, "u16"), SPLIT_TENSORS: (5, "i32")}  # as llama.cpp reads them
_TYPE_NAMES = {
    0: "u8",
    1: "i8",
    2: "u16",
    3: "i16",
    4: "u32",
    5: "i32",
    6: "f32",
    7: "bool",
    8: "string",
    9: "array",
    10: "u64",
    11: "i64",
    12: "f64",
}


def shard_name(prefix: str, no: int, count: int) -> str:
    """The path of shard `no` (0-based) of `count`, as gguf-split and llama.cpp name them."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def split_prefix(path: str, no: int, count: int) -> str | None:
    """The common prefix of a shard set from one shard's path, None if the name is not shard `no` of `count`."""
    suffix = shard_name("", no, count)
    return path[: -len(suffix)] if path.endswith(suffix) and len(path) > len(suffix) else None


def _open_file(path: str) -> tuple[int, int]:
    """(read-only descriptor, size) of a regular file; errors as one line naming it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise StreamerError(f"cannot open {path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StreamerError(f"cannot open {path}: {'Is a directory' if stat.S_ISDIR(st.st_mode) else 'not a file'}")
    if st.st_size < 24:
        os.close(fd)
        raise StreamerError(f"{path} is not a GGUF file (only {st.st_size} bytes)")
    return fd, st.st_size


def _map(paths: list[str], fds: list[int], sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    try:
        return map_files(fds, sizes)
    except OSError as e:
        raise StreamerError(
            f"cannot map {paths[0]}{' and its shards' if len(paths) > 1 else ''}: {e.strerror or e}"
        ) from None


class GGUFFile:
    """A GGUF model opened read-only: one file, or every shard of a split model given its first shard.
    `fields` holds the (first file's) metadata; `view(name)` is a zero-copy tensor view, whichever shard
    holds it. Each file is its own read-only mapping; all sit side by side in `mm` (streamer/mapping.py)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        fd, size = _open_file(self.path)
        fds = [fd]
        try:
            mm, _ = _map([self.path], fds, [size])
            first = _Header(self.path, mm, 0, size)
            count = self._split_count(first)
            if count <= 1:
                headers = [first]
            else:
                paths = self._shard_paths(count)
                del mm, first  # mapped again below, all shards side by side
                sizes = [size]
                for p in paths[1:]:
                    fd_i, size_i = self._open_shard(p, paths, count)
                    fds.append(fd_i)
                    sizes.append(size_i)
                mm, bases = _map(paths, fds, sizes)
                headers = [_Header(p, mm, b, n, i) for i, (p, b, n) in enumerate(zip(paths, bases, sizes))]
        finally:
            for f in fds:  # the mappings stay valid without the descriptors
                os.close(f)
        self.mm = mm
        self._buf = memoryview(mm)
        self.fields = headers[0].fields
        self.tensors: dict[str, TensorInfo] = {}
        for h in headers:
            if len(headers) > 1:
                self._check_shard(h, count)
            for name, t in h.tensors.items():
                if name in self.tensors:
                    raise StreamerError(
                        f"{h.path}: tensor '{_show(name)}' is also in "
                        f"{headers[self.tensors[name].shard].path} (a tensor in two shards)"
                    )
                self.tensors[name] = t
        if len(headers) > 1:
            want = self.fields.get(SPLIT_TENSORS)
            if want != len(self.tensors):
                raise StreamerError(
                    f"{self.path}: {SPLIT_TENSORS} is {want}, but its {count} shards hold {len(self.tensors)} tensors"
                )
        self.shards = [Shard(h.path, h.base, h.size, h.data_start, len(h.tensors)) for h in headers]
        self.size = sum(h.size for h in headers)
        self.data_start = headers[0].data_start

    @property
    def files(self) -> list[tuple[str, int]]:
        """(path, base in mm) of every file of the model: one, or each shard of a split model."""
        return [(s.path, s.base) for s in self.shards]

    @staticmethod
    def _split_key(h: _Header, key: str, required: bool = True):
        """A split.* key of header h, checked for llama.cpp's type; None if absent and not required."""
        if key not in h.fields:
            if required:
                raise StreamerError(f"{h.path}: missing metadata key '{key}' (a shard of a split model has it)")
            return None
        code, tname = _SPLIT_TYPES[key]
        if h.types[key] != code:
            raise StreamerError(
                f"{h.path}: metadata key '{key}' is a {_TYPE_NAMES.get(h.types[key], '?')}, expected a {tname}"
            )
        return h.fields[key]

    def _split_count(self, first: _Header) -> int:
        count = self._split_key(first, SPLIT_COUNT, required=False)
        if count is None or count <= 1:
            return 1
        no = self._split_key(first, SPLIT_NO)
        if no != 0:
            prefix = split_prefix(self.path, no, count)
            hint = f": open the first shard, {shard_name(prefix, 0, count)}" if prefix else ": open the first shard"
            raise StreamerError(f"{self.path} is shard {no + 1} of {count} of a split model{hint}")
        self._split_key(first, SPLIT_TENSORS)
        return count

    def _shard_paths(self, count: int) -> list[str]:
        prefix = split_prefix(self.path, 0, count)
        if prefix is None:
            raise StreamerError(
                f"{self.path} is the first of {count} shards, but its name does not end in "
                f"{shard_name('', 0, count)}, so the others cannot be found (keep gguf-split's names)"
            )
        return [shard_name(prefix, i, count) for i in range(count)]

    @staticmethod
    def _open_shard(path: str, paths: list[str], count: int) -> tuple[int, int]:
        if not os.path.exists(path):
            raise StreamerError(f"{path} is missing: shard {paths.index(path) + 1} of {count} of {paths[0]}")
        return _open_file(path)

    def _check_shard(self, h: _Header, count: int) -> None:
        no, n = self._split_key(h, SPLIT_NO), self._split_key(h, SPLIT_COUNT)
        if no != h.shard or n != count:
            raise StreamerError(
                f"{h.path}: its split.no/split.count say shard {no + 1} of {n}, but by name it is "
                f"shard {h.shard + 1} of {count} of {self.path}"
            )

    # ---- metadata ----
    @property
    def arch(self) -> str:
        arch = self.scalar(Keys.General.ARCHITECTURE, str)
        if arch is None:
            raise StreamerError(f"{self.path} has no general.architecture key")
        return arch

    def get(self, key: str, default=None):
        """A metadata value: scalars as Python values, numeric arrays as numpy views, string arrays as list[str]."""
        val = self.fields.get(key, default)
        if isinstance(val, _StringArray):
            val = self.get_strings(key)
        return val

    def scalar(self, key: str, kind: type, default=None):
        """The value of `key` if it is a scalar of `kind` (int, float, str or bool; an integer is also a
        float), `default` if the key is absent; any other value is an error naming the key."""
        val = self.fields.get(key)
        if val is None:
            return default
        if kind is int or kind is float:
            ok = isinstance(val, (int, float) if kind is float else int) and not isinstance(val, bool)
        else:
            ok = isinstance(val, kind)
        if not ok:
            raise StreamerError(
                f"{self.path}: metadata key '{_show(key)}' is {_describe(val)}, expected {_KINDS[kind]}"
            )
        return kind(val)

    def array(self, key: str, kind: type) -> np.ndarray | None:
        """The numeric array `key` (kind int: of integers; float: of any numbers), None if absent."""
        val = self.fields.get(key)
        if val is None:
            return None
        if not isinstance(val, np.ndarray) or val.dtype.kind not in ("iu" if kind is int else "iuf"):
            raise StreamerError(
                f"{self.path}: metadata key '{_show(key)}' is {_describe(val)}, "
                f"expected an array of {'integers' if kind is int else 'numbers'}"
            )
        return val

    def string_count(self, key: str) -> int:
        """How many strings the string array `key` holds (without decoding them)."""
        arr = self.fields.get(key)
        if not isinstance(arr, _StringArray):
            raise StreamerError(
                f"{self.path}: metadata key '{_show(key)}' is {_describe(arr)}, expected an array of strings"
            )
        return arr.count

    def get_strings(self, key: str, errors: str = "strict") -> list[str]:
        """Decode a string array in one pass (the vocabulary is only decoded when the tokenizer asks)."""
        return [b.decode("utf-8", errors=errors) for b in self.get_string_bytes(key)]

    def get_string_bytes(self, key: str) -> list[bytes]:
        self.string_count(key)
        arr = self.fields[key]
        buf, off, out = self._buf, arr.start, []  # memoryview slices: no np.memmap object per string
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(arr.count):
            (n,) = unpack(buf, off)
            out.append(buf[off + 8 : off + 8 + n].tobytes())
            off += 8 + n
        return out

    def array_len(self, key: str) -> int | None:
        val = self.fields.get(key)
        if isinstance(val, _StringArray):
            return val.count
        return None if val is None or isinstance(val, (str, int, float)) else len(val)

    # ---- tensors ----
    def view(self, name: str) -> np.ndarray:
        """Zero-copy view: float types as (…, n) of their dtype, quantized types as uint8 (…, row_bytes)."""
        t = self.tensors[name]
        raw = self.mm[t.offset : t.offset + t.nbytes]
        if t.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(t.shape)
        if t.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(t.shape)
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        return raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)

    in_memory = False  # read_into_memory replaced the mapping by a copy in the process's memory

    def read_into_memory(self, direct: bool | None = None, progress=None) -> None:
        """--no-mmap: replace the mapping by a copy of every file in the process's own memory, same layout
        (streamer/inram.py). Call it before taking any tensor view: views taken after it are into the copy."""
        shards = [(s.path, s.base, s.size) for s in self.shards]
        self.mm = read_into_memory(shards, self.mm.size, direct, progress)
        self.mm.flags.writeable = False  # as the mapping: the same array types, so the warm-up's kernels serve it
        self._buf = memoryview(self.mm)  # the mapping goes when nothing else holds it (metadata arrays may)
        self.in_memory = True

    def advise(self, ranges, advice: int) -> None:
        """madvise byte ranges (offset, length) of the mapping, e.g. mmap.MADV_WILLNEED: a hint only (none on
        a copy in memory)."""
        if self.mm is None or self.in_memory:
            return
        for start, n in ranges:
            madvise(self.mm, start, n, advice)

    def drop_cached(self, start: int, n: int) -> None:
        """Evict the page cache of mapping bytes [start, start + n) (POSIX_FADV_DONTNEED on each file they fall
        in): pages nobody maps go and are read again on their next use. The model's content is unchanged."""
        for s in self.shards:
            a, b = max(start, s.base), min(start + n, s.base + s.size)
            if a < b:
                fd = os.open(s.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, a - s.base, b - a, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def close(self) -> None:
        self._buf.release()
        self.mm = None


def model_key(gf) -> str:
    """Identity of a model file: hash of its header (metadata + tensor table) and its size. Cheap, and it
    changes when the file is replaced by a different model."""
    h = hashlib.sha256()
    for s in gf.shards:  # every file of a split model (one file: its header, then its size, as always)
        h.update(gf.mm[s.base : s.base + s.data_start].tobytes())
        h.update(str(s.size).encode())
    return h.hexdigest()[:24]
