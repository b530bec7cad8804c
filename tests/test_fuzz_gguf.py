"""Hostile GGUF files: truncation at every structural boundary, hundreds of seeded mutations of a valid tiny
file's header (dense and MoE), and hand-made variants for each bug class the fuzzer found. Every variant
must either load and run one forward, or raise StreamerError with a one-line message: never another
exception, a hang or an allocation the file cannot account for.

The file's structure is located with gguf-py's GGUFReader (each field's parts in file order), not with the
loader under test. Mutations are patched into one working copy in place and undone after each variant, so
the 14 MB MoE file is never copied per variant; truncations go from the longest to the shortest.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as V
from gguf.constants import GGMLQuantizationType
from numba.core import event as numba_event
from numba.core.dispatcher import Dispatcher

from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.options import StreamOptions
from streamer.session import open_model
from streamer.warmup import COMPILE_JOBS_ENV

# garbage weights overflow float16 KV entries and NaN the router softmax: expected, and not the point here
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

N_VARIANTS = {"tiny": 240, "tiny-moe": 160}  # 400 seeded mutations (the slow tier)
N_SAMPLE = 24  # the fast tier's sample: the first seeds of each preset
TIMEOUT_S = 10  # per variant: a hang guard (kernels are warmed up first; a variant takes ~10-50 ms)
MEM_SLACK = 64 << 20  # a variant may allocate at most this plus twice the file size

INT_ROLES = (
    "version",
    "n_tensors",
    "n_kv",
    "key_len",
    "str_len",
    "count",
    "elem_len",
    "value",
    "name_len",
    "n_dims",
    "dim",
    "toffset",
)
EXTREMES = (0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1)
GGML_TYPES = sorted(int(t) for t in GGMLQuantizationType)
BAD_GGML_TYPES = (4, 5, 31, 42, 1000, 2**32 - 1)
VALUE_TYPES = [int(t) for t in V]
HYPER = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "head_count",
    "head_count_kv",
    "key_length",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "token_id",
)


# ---- the valid file's structure, from gguf-py ----
@dataclass(frozen=True)
class Slot:
    off: int
    size: int
    role: str  # magic, version, n_tensors, n_kv, key_len, key, vtype, value, fvalue, bvalue, str_len, str,
    #            etype, count, elem_len, elem, array_data, name_len, name, n_dims, dim, ttype, toffset
    dtype: str  # numpy dtype of the part
    where: str  # the key or tensor the slot belongs to


@dataclass
class Layout:
    size: int
    slots: list[Slot]
    infos_end: int  # end of the tensor-info table
    data_start: int
    alignment: int
    tensors: list[tuple[str, int, int]]  # name, absolute data offset, bytes

    def of(self, role: str, where: str | None = None) -> list[Slot]:
        return [s for s in self.slots if s.role == role and (where is None or where in s.where)]

    def field(self, key: str) -> tuple[int, int]:
        """(start, end) of a whole key/value entry."""
        mine = [s for s in self.slots if s.where == key]
        return mine[0].off, mine[-1].off + mine[-1].size

    def boundaries(self) -> list[int]:
        b = {s.off for s in self.slots} | {self.infos_end, self.data_start}
        for _, off, n in self.tensors:
            b |= {off, off + n}
        return sorted(b)


def _field_roles(name: str, f) -> list[str]:
    if name.startswith("GGUF."):
        return [{"GGUF.version": "version", "GGUF.tensor_count": "n_tensors", "GGUF.kv_count": "n_kv"}[name]]
    roles = ["key_len", "key", "vtype"]
    t0 = f.types[0]
    if t0 == V.STRING:
        return roles + ["str_len", "str"]
    if t0 == V.ARRAY:
        roles += ["etype", "count"]
        if f.types[1] == V.STRING:
            return roles + ["elem_len", "elem"] * ((len(f.parts) - 5) // 2)
        return roles + ["array_data"] * (len(f.parts) - 5)
    return roles + ["fvalue" if t0 in (V.FLOAT32, V.FLOAT64) else "bvalue" if t0 == V.BOOL else "value"]


def layout(path) -> Layout:
    r = GGUFReader(str(path))
    slots = [Slot(0, 4, "magic", "|u1", "header")]

    def add(offset, parts, roles, where):
        assert len(parts) == len(roles), where
        for p, role in zip(parts, roles):
            if role == "dim":  # all dims are one part: one slot each
                slots.extend(Slot(offset + 8 * i, 8, "dim", "<u8", where) for i in range(p.size))
            else:
                slots.append(Slot(offset, p.nbytes, role, p.dtype.str, where))
            offset += p.nbytes
        return offset

    off = 4
    for name, f in r.fields.items():
        assert f.offset == off, (name, f.offset, off)  # parts are contiguous: the walk is complete
        off = add(f.offset, f.parts, _field_roles(name, f), name)
    for t in r.tensors:
        assert t.field.offset == off, t.name
        off = add(off, t.field.parts, ["name_len", "name", "n_dims", "dim", "ttype", "toffset"], t.name)
    assert r.data_offset == -(-off // r.alignment) * r.alignment
    tensors = [(t.name, int(t.data_offset), int(t.n_bytes)) for t in r.tensors]
    size = os.path.getsize(path)
    assert max(o + n for _, o, n in tensors) <= size
    return Layout(size, slots, off, r.data_offset, r.alignment, tensors)


# ---- running one variant ----
def test_kernels_give_nan_for_nan_input():
    """Garbage weights (a norm's offset moved onto quantized bytes, Q8_0 relabelled as F32) make NaN or infinite
    activations. With fastmath and numba's default 'python' error model, `1 / sqrt(NaN)` raised
    ZeroDivisionError (a traceback at the CLI); the kernels use error_model='numpy': NaN in, NaN out."""
    from streamer.kernels import ops

    x = np.full((1, 8), np.nan, np.float32)
    out = ops.rmsnorm(x, np.ones(8, np.float32), 1e-6, np.empty_like(x))
    assert np.isnan(out).all()
    g = np.full((1, 8), np.nan, np.float32)
    assert np.isnan(ops.swiglu(g, np.zeros((1, 8), np.float32), np.empty_like(g))).all()


class Hang(BaseException):
    """Raised by SIGALRM in the variant that takes too long (not an Exception: nothing may swallow it)."""


def _on_alarm(signum, frame):
    raise Hang()


class CompilePause(numba_event.Listener):
    """A numba event listener that stops the hang guard's clock while numba compiles: a mutated tensor type may need
    kernels of a format that no earlier test in this process put in numba's cache (with the tests spread over
    processes, nothing says which ran first), and a minute of compiling is not a hang in the loader. Nor is the
    compiler's memory the variant's: `compiles` counts them, and the memory checks skip a variant that compiled.
    `loads` counts kernels added to a dispatcher, compiled or loaded from numba's cache (counted(), installed by
    the harness): a cached kernel loaded for the first time in this process costs memory too (tens of MB for a
    new format's, LLVM's), and whether a format's kernels come from the cache or the compiler depends on what
    ran before on this machine."""

    def __init__(self):
        self.depth, self.left, self.compiles, self.loads = 0, 0.0, 0, 0

    def counted(self, add_overload):
        """Dispatcher.add_overload, counting into `loads`."""

        def add(dispatcher, cres):
            self.loads += 1
            return add_overload(dispatcher, cres)

        return add

    def on_start(self, event):
        self.compiles += 1
        if self.depth == 0:
            self.left = signal.setitimer(signal.ITIMER_REAL, 0)[0]  # what was left of the variant's time, or 0
        self.depth += 1

    def on_end(self, event):
        self.depth -= 1
        if self.depth == 0 and self.left > 0:
            signal.setitimer(signal.ITIMER_REAL, self.left)


def load_and_run(path, moe: bool, n_ctx=None) -> None:
    """Everything the CLI does before generating: open (file, config, model, kernels), the tokenizer with its
    merges (decoded on the first encode), and one forward of two tokens. One kernel thread: the two shared
    cores are busy enough, and threading is not what is being fuzzed."""
    s = open_model(path, StreamOptions(learn=False), n_ctx=n_ctx, threads=1)
    try:
        s.tokenizer.encode("Hello world")
        logits = s.model.forward([1, 2], s.model.new_state())
        assert logits.shape == (s.cfg.n_vocab,)
    finally:
        s.close()


def open_file(path, moe: bool) -> None:
    """The file layer alone: a truncated file must be refused there, before anything else reads it."""
    GGUFFile(path)


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@pytest.fixture(scope="module")
def harness(files):
    """check(label, path, moe, traced=False, load=load_and_run, **kw) runs one variant: None if it loaded and
    ran, else its StreamerError message; anything else fails the test, naming the variant. Time is bounded by
    SIGALRM. Memory: the process's peak RSS may never grow past MEM_SLACK + 2 x the file size (every variant),
    and with traced=True the tracemalloc peak of the variant itself is held to the same bound (tracemalloc
    slows the parser ~10x, so the seeded runs trace a sample)."""
    import numba

    # kernels compile in this process only: a helper process's compile is time the alarm would count
    jobs = os.environ.get(COMPILE_JOBS_ENV)
    os.environ[COMPILE_JOBS_ENV] = "1"
    threads = numba.get_num_threads()
    for preset, (path, _) in files.items():  # the seed files' kernels compiled or loaded now, not mid-variant (time,
        load_and_run(path, preset == "tiny-moe")  # memory); each format's are compiled apart (kernels/specialise.py)
    old = signal.signal(signal.SIGALRM, _on_alarm)
    pause = CompilePause()
    numba_event.register("numba:compile", pause)
    add_overload = Dispatcher.add_overload
    Dispatcher.add_overload = pause.counted(add_overload)
    rss = [_max_rss()]
    stats = {"loaded": 0, "rejected": 0, "traced": 0, "compiled": 0, "worst_s": 0.0, "worst_traced_mb": 0.0}

    def check(label: str, path, moe: bool, traced: bool = False, load=load_and_run, **kw) -> str | None:
        limit = MEM_SLACK + 2 * os.path.getsize(path)
        if traced:
            tracemalloc.start()
        t0, compiles, loads = time.perf_counter(), pause.compiles, pause.loads
        signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
        msg = None
        try:
            load(path, moe, **kw)
        except StreamerError as e:
            msg = str(e)
        except Hang:
            pytest.fail(f"{label}: still loading after {TIMEOUT_S} s")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect being hunted
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            peak = tracemalloc.get_traced_memory()[1] if traced else 0
            tracemalloc.stop()
        stats["worst_s"] = max(stats["worst_s"], time.perf_counter() - t0)
        stats["traced"] += traced
        stats["worst_traced_mb"] = max(stats["worst_traced_mb"], peak / 2**20)
        grown = _max_rss() - rss[0]
        if pause.compiles > compiles or pause.loads > loads:  # numba's memory, not the variant's: judge from here
            rss[0] = _max_rss()
            stats["compiled"] += 1
        else:
            assert peak <= limit, f"{label}: allocated {peak >> 20} MB (tracemalloc peak) for a {limit >> 20} MB bound"
            if grown > limit:
                rss[0] = _max_rss()  # a high-water mark: judge the variants after this one from here
                pytest.fail(f"{label}: peak RSS grew by {grown >> 20} MB, more than {limit >> 20} MB")
        if msg is None:
            stats["loaded"] += 1
        else:
            stats["rejected"] += 1
            assert msg.strip() and "\n" not in msg, f"{label}: message is not one line: {msg!r}"
        return msg

    check.stats = stats
    yield check
    Dispatcher.add_overload = add_overload
    numba_event.unregister("numba:compile", pause)
    signal.signal(signal.SIGALRM, old)
    numba.set_num_threads(threads)
    if jobs is None:
        os.environ.pop(COMPILE_JOBS_ENV, None)
    else:
        os.environ[COMPILE_JOBS_ENV] = jobs
    print(f"\nfuzz: {stats}")


class Bench:
    """One working copy of a valid file; patches are written in place and undone after each variant."""

    def __init__(self, src: Path, dst: Path):
        shutil.copy(src, dst)
        self.path, self.orig = dst, src.read_bytes()

    @contextmanager
    def patched(self, patches: list[tuple[int, bytes]]):
        fd = os.open(self.path, os.O_RDWR)
        try:
            for off, b in patches:
                os.pwrite(fd, b, off)
            yield self.path
        finally:
            for off, b in patches:
                os.pwrite(fd, self.orig[off : off + len(b)], off)
            os.close(fd)


@pytest.fixture(scope="module")
def files(synth_model):
    """preset -> (valid file, its layout). (The MoE runs pass learn=False: no usage sidecar is written.)"""
    out = {}
    for preset in N_VARIANTS:
        path = synth_model(preset, "Q8_0")
        out[preset] = (path, layout(path))
    return out


def uint(value: int, size: int) -> bytes:
    return (value % (1 << (8 * size))).to_bytes(size, "little")


# ---- seeded mutations ----
def mutation(rng: np.random.Generator, lay: Layout, orig: bytes) -> tuple[str, list[tuple[int, bytes]]]:
    """One random mutation: (description, [(offset, new bytes)])."""
    kind = rng.choice(
        ["int", "hyper", "type", "float", "array", "dup", "flip"], p=[0.34, 0.14, 0.2, 0.04, 0.06, 0.06, 0.16]
    )
    if kind in ("int", "hyper"):
        if kind == "hyper":
            cands = [s for s in lay.of("value") if any(h in s.where for h in HYPER)]
        else:
            role = INT_ROLES[rng.integers(len(INT_ROLES))]
            cands = lay.of(role) or lay.of("value")
        s = cands[rng.integers(len(cands))]
        old = int.from_bytes(orig[s.off : s.off + s.size], "little")
        choices = [
            *EXTREMES,
            old + 1,
            old - 1,
            old * 2,
            old // 2,
            old + lay.alignment,
            int(rng.integers(0, 2**63)) * 2 + int(rng.integers(2)),
        ]
        new = choices[rng.integers(len(choices))]
        return f"{s.where} {s.role} @{s.off}: {old} -> {new % (1 << 8 * s.size)}", [(s.off, uint(new, s.size))]
    if kind == "type":
        role = ("vtype", "etype", "ttype")[rng.integers(3)]
        cands = lay.of(role)
        s = cands[rng.integers(len(cands))]
        pool = GGML_TYPES + list(BAD_GGML_TYPES) if role == "ttype" else VALUE_TYPES + [13, 255, 2**32 - 1]
        new = pool[rng.integers(len(pool))]
        return f"{s.where} {role} @{s.off} -> {new}", [(s.off, uint(new, 4))]
    if kind == "float":
        s = lay.of("fvalue")[rng.integers(len(lay.of("fvalue")))]
        new = [0.0, -1.0, float("nan"), float("inf"), 1e30, 1e-30][rng.integers(6)]
        return f"{s.where} = {new}", [(s.off, struct.pack("<f" if s.size == 4 else "<d", new))]
    if kind == "array":  # one element of a numeric array (token types)
        s = lay.of("array_data")[rng.integers(len(lay.of("array_data")))]
        item = np.dtype(s.dtype).itemsize
        i = int(rng.integers(s.size // item))
        new = EXTREMES[rng.integers(len(EXTREMES))]
        return f"{s.where}[{i}] -> {new}", [(s.off + i * item, uint(new, item))]
    if kind == "dup":  # a tensor name (or key) overwritten by another of the same length
        role = ("name", "key")[rng.integers(2)]
        slots = lay.of(role)
        a = slots[rng.integers(len(slots))]
        same = [s for s in slots if s.size == a.size and s.off != a.off]
        if not same:
            return f"{a.where}: no same-length name to copy", []
        b = same[rng.integers(len(same))]
        return f"{role} {a.where!r} renamed {b.where!r}", [(a.off, orig[b.off : b.off + b.size])]
    n = int(rng.integers(1, 9))  # flip: random bytes of the header
    offs = rng.integers(0, lay.infos_end, size=n)
    return f"bytes {sorted(offs.tolist())} randomised", [(int(o), bytes([int(rng.integers(256))])) for o in offs]


@pytest.mark.parametrize(
    "preset,n",
    [(p, N_SAMPLE) for p in N_VARIANTS] + [pytest.param(p, n, marks=pytest.mark.slow) for p, n in N_VARIANTS.items()],
)
def test_seeded_mutations(preset, n, files, harness, tmp_path):
    src, lay = files[preset]
    bench = Bench(src, tmp_path / "m.gguf")
    moe = preset == "tiny-moe"
    assert harness(f"{preset} unmodified", bench.path, moe) is None
    base = 0 if preset == "tiny" else 10_000
    outcomes = {"loaded": 0, "rejected": 0}
    sample = n < N_VARIANTS[preset]  # the fast tier's sample leaves out tensor-type changes: each new format
    seed, done = base - 1, 0  # compiles every kernel's every-format version, minutes of numba for one variant
    while done < n:
        seed += 1
        what, patches = mutation(np.random.default_rng(seed), lay, bench.orig)
        if sample and "ttype" in what:
            continue
        done += 1
        with bench.patched(patches) as path:
            msg = harness(f"{preset} seed {seed} ({what})", path, moe, traced=seed % 8 == 0)
        outcomes["loaded" if msg is None else "rejected"] += 1
        if seed % 64 == 63:
            gc.collect()
    # the mix really exercises both paths: some mutations are harmless, most are caught
    assert outcomes["loaded"] >= min(10, n // 24) and outcomes["rejected"] >= n // 2, outcomes


# ---- truncation at every structural boundary ----
@pytest.mark.slow
@pytest.mark.parametrize("preset", list(N_VARIANTS))
def test_truncation_at_every_boundary(preset, files, harness, tmp_path):
    """Cut the file at (and one byte either side of) every field, tensor-info part and tensor start/end.
    The vocabulary's string elements are all cut in the dense file, and at both ends only in the MoE one
    (same vocabulary). Cuts go from the end backwards, so one copy is shortened step by step."""
    src, lay = files[preset]
    moe = preset == "tiny-moe"
    bounds = lay.boundaries()
    if moe:
        elems = [s.off for s in lay.slots if s.role in ("elem_len", "elem")]
        bounds = sorted(set(bounds) - set(elems[6:-6]))
    data_end = max(off + n for _, off, n in lay.tensors)  # the writer pads the file after it: cutting that is harmless
    cuts = sorted({c for b in bounds for c in (b - 1, b, b + 1) if 0 <= c < data_end}, reverse=True)
    path = tmp_path / "cut.gguf"
    shutil.copy(src, path)
    for i, cut in enumerate(cuts):
        os.truncate(path, cut)
        msg = harness(f"{preset} cut at {cut} of {lay.size}", path, moe, load=open_file)
        assert msg is not None, f"{preset}: the file cut at byte {cut} loaded"
        if i % 256 == 255:
            gc.collect()
    assert len(cuts) > 300


# ---- hand-made variants, one per bug class the fuzzer found (and the brief's suspects) ----
_PACK = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.BOOL: "?",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
}


def pack(vtype: int, value) -> bytes:
    """A GGUF value without its type; an array is (element type, items), nested arrays likewise."""
    if vtype == V.STRING:
        b = value.encode()
        return struct.pack("<Q", len(b)) + b
    if vtype == V.ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(pack(etype, v) for v in items)
    return struct.pack("<" + _PACK[V(vtype)], value)


def entry(key: str, vtype: int, value) -> bytes:
    return pack(V.STRING, key) + struct.pack("<I", vtype) + pack(vtype, value)


def rebuild(lay: Layout, orig: bytes, drop=(), add=()) -> bytes:
    """The file with the metadata entries of `drop` removed and the encoded entries `add` appended, the
    key count adjusted and the tensor data realigned (tensor offsets are relative to the data start)."""
    kv_end = lay.of("name_len")[0].off
    cut = [lay.field(k) for k in drop]
    kept = bytearray(orig[24:kv_end])
    for start, end in sorted(cut, reverse=True):
        del kept[start - 24 : end - 24]
    n_kv = struct.unpack_from("<Q", orig, 16)[0] - len(cut) + len(add)
    head = orig[:16] + struct.pack("<Q", n_kv) + bytes(kept) + b"".join(add) + orig[kv_end : lay.infos_end]
    return head + bytes(-len(head) % lay.alignment) + orig[lay.data_start :]


def replace(key: str, vtype: int, value):
    return lambda lay, orig: rebuild(lay, orig, drop=[key], add=[entry(key, vtype, value)])


def append(*entries: bytes):
    return lambda lay, orig: rebuild(lay, orig, add=list(entries))


def patch(role: str, where: str, value: int):
    """Overwrite the first integer slot of `role` in `where` (a key or tensor name)."""

    def build(lay, orig):
        s = next(s for s in lay.slots if s.role == role and s.where == where)
        out = bytearray(orig)
        out[s.off : s.off + s.size] = uint(value, s.size)
        return bytes(out)

    return build


def rename(tensor: str, to: str):
    def build(lay, orig):
        s = next(s for s in lay.slots if s.role == "name" and s.where == tensor)
        assert len(to) == s.size
        return orig[: s.off] + to.encode() + orig[s.off + s.size :]

    return build


def shift_offset(tensor: str, delta: int):
    def build(lay, orig):
        s = next(s for s in lay.slots if s.role == "toffset" and s.where == tensor)
        return patch("toffset", tensor, struct.unpack_from("<Q", orig, s.off)[0] + delta)(lay, orig)

    return build


def deep_nest(depth: int) -> bytes:
    """A key holding `depth` levels of one-element arrays around an empty array of uint32."""
    return (
        pack(V.STRING, "test.nested")
        + struct.pack("<I", V.ARRAY)
        + struct.pack("<IQ", V.ARRAY, 1) * (depth - 1)
        + struct.pack("<IQ", V.UINT32, 0)
    )


TOK, N_TOK = "tokenizer.ggml", 381
BYTE_TOKENS = [chr(c) for c in range(0x100, 0x100 + N_TOK + 1)]  # distinct strings (not the real byte map)
EPS, THETA = "qwen3.attention.layer_norm_rms_epsilon", "qwen3.rope.freq_base"
NEST3 = (V.ARRAY, [(V.ARRAY, [(V.INT32, [1, 2])]), (V.ARRAY, [])])
CASES = [  # (id, preset, build, expected message regex, or None: loads and runs)
    (
        "block_count-string",
        "tiny",
        replace("qwen3.block_count", V.STRING, "2"),
        r"metadata key 'qwen3.block_count' is the string '2', expected an integer",
    ),
    (
        "block_count-float",
        "tiny",
        replace("qwen3.block_count", V.FLOAT32, 2.0),
        r"'qwen3.block_count' is 2.0, expected an integer",
    ),
    (
        "block_count-array",
        "tiny",
        replace("qwen3.block_count", V.ARRAY, (V.UINT32, [2])),
        r"'qwen3.block_count' is an array of 1 uint32, expected an integer",
    ),
    (
        "block_count-2**40",
        "tiny",
        replace("qwen3.block_count", V.UINT64, 2**40),
        r"qwen3.block_count is 1099511627776, but the file has only 25 tensors",
    ),
    (
        "head_count-0",
        "tiny",
        replace("qwen3.attention.head_count", V.UINT32, 0),
        r"bad model geometry in metadata: n_head\b",
    ),
    (
        "head_count_kv-0",
        "tiny",
        replace("qwen3.attention.head_count_kv", V.UINT32, 0),
        r"geometry in metadata: n_head_kv",
    ),
    ("key_length-63", "tiny", replace("qwen3.attention.key_length", V.UINT32, 63), r"head_dim \(must be even"),
    ("embedding_length-0", "tiny", replace("qwen3.embedding_length", V.UINT32, 0), r"geometry in metadata: n_embd"),
    ("context_length-0", "tiny", replace("qwen3.context_length", V.UINT32, 0), r"geometry in metadata: n_ctx_train"),
    ("context_length-2**40", "tiny", replace("qwen3.context_length", V.UINT64, 2**40), None),  # -c defaults to 4096
    ("rms_eps-0", "tiny", replace(EPS, V.FLOAT32, 0.0), r"rms_eps 0\.0"),
    ("rms_eps-nan", "tiny", replace(EPS, V.FLOAT32, float("nan")), r"rms_eps nan"),
    ("rope_theta-0", "tiny", replace(THETA, V.FLOAT32, 0.0), r"rope_theta 0\.0"),
    ("rope_theta-int", "tiny", replace(THETA, V.UINT32, 1000000), None),  # an integer is a number
    (
        "arch-number",
        "tiny",
        replace("general.architecture", V.UINT32, 3),
        r"metadata key 'general.architecture' is 3, expected a string",
    ),
    (
        "alignment-string",
        "tiny",
        append(entry("general.alignment", V.STRING, "32")),
        r"general.alignment is the string '32', not a positive power of two",
    ),
    (
        "duplicate-key",
        "tiny",
        append(entry("qwen3.block_count", V.UINT32, 2)),
        r"metadata key 'qwen3.block_count' appears twice",
    ),
    (
        "unknown-value-type",
        "tiny",
        append(pack(V.STRING, "test.x") + struct.pack("<II", 13, 0)),
        r"metadata key 'test.x' has unknown GGUF value type 13",
    ),
    ("nested-3", "tiny", append(entry("test.nested", V.ARRAY, NEST3)), None),
    ("nested-100000", "tiny", append(deep_nest(100_000)), r"metadata key 'test.nested' nests arrays more than 8 deep"),
    (
        "strings-2**62",
        "tiny",
        append(pack(V.STRING, "test.s") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**62)),
        r"truncated or corrupt: metadata key 'test.s' claims 4611686018427387904 array elements",
    ),
    (
        "token_type-short",
        "tiny",
        replace(f"{TOK}.token_type", V.ARRAY, (V.INT32, [1] * (N_TOK - 1))),
        rf"{TOK}.token_type has 380 entries for 381 tokens",
    ),
    (
        "token_type-strings",
        "tiny",
        replace(f"{TOK}.token_type", V.ARRAY, (V.STRING, ["1"] * N_TOK)),
        rf"'{TOK}.token_type' is an array of 381 strings, expected an array of integers",
    ),
    (
        "scores-long",
        "tiny",
        append(entry(f"{TOK}.scores", V.ARRAY, (V.FLOAT32, [0.0] * (N_TOK + 1)))),
        rf"{TOK}.scores has 382 entries for 381 tokens",
    ),
    ("scores-ok", "tiny", append(entry(f"{TOK}.scores", V.ARRAY, (V.FLOAT32, [0.0] * N_TOK))), None),
    (
        "tokens-numbers",
        "tiny",
        replace(f"{TOK}.tokens", V.ARRAY, (V.INT32, list(range(N_TOK)))),
        rf"'{TOK}.tokens' is an array of 381 int32, expected an array of strings",
    ),
    (
        "tokens-one-extra",
        "tiny",
        replace(f"{TOK}.tokens", V.ARRAY, (V.STRING, BYTE_TOKENS)),
        r"the vocabulary has 382 tokens but 'token_embd.weight' has 381 rows",
    ),
    (
        "merges-malformed",
        "tiny",
        replace(f"{TOK}.merges", V.ARRAY, (V.STRING, ["a b", "abc"])),
        r"BPE merge #1 'abc' is not two symbols separated by a space",
    ),
    (
        "merges-numbers",
        "tiny",
        replace(f"{TOK}.merges", V.ARRAY, (V.INT32, [1, 2])),
        rf"'{TOK}.merges' is an array of 2 int32, expected an array of strings",
    ),
    ("bos-out-of-range", "tiny", replace(f"{TOK}.bos_token_id", V.UINT32, N_TOK), r"bos token id 381 is out of range"),
    ("bos-string", "tiny", replace(f"{TOK}.bos_token_id", V.STRING, "1"), rf"'{TOK}.bos_token_id' is the string '1'"),
    (
        "add_bos-uint8",
        "tiny",
        replace(f"{TOK}.add_bos_token", V.UINT8, 1),
        rf"'{TOK}.add_bos_token' is 1, expected a boolean",
    ),
    (
        "chat_template-number",
        "tiny",
        replace("tokenizer.chat_template", V.INT32, 7),
        r"'tokenizer.chat_template' is 7, expected a string",
    ),
    (
        "tokenizer_model-array",
        "tiny",
        replace(f"{TOK}.model", V.ARRAY, (V.STRING, ["gpt2"])),
        rf"'{TOK}.model' is an array of 1 strings, expected a string",
    ),
    ("eot-out-of-range", "tiny", append(entry(f"{TOK}.eot_token_id", V.UINT32, 10**6)), None),  # ignored, as llama.cpp
    (
        "duplicate-tensor",
        "tiny",
        rename("blk.0.attn_k.weight", "blk.0.attn_q.weight"),
        r"tensor 'blk.0.attn_q.weight' appears twice in the tensor table",
    ),
    (
        "misaligned-offset",
        "tiny",
        shift_offset("blk.1.attn_q.weight", 2),
        r"tensor 'blk.1.attn_q.weight' has data offset \d+, not a multiple of the alignment 32",
    ),
    ("n_dims-0", "tiny", patch("n_dims", "output_norm.weight", 0), r"tensor 'output_norm.weight' has 0 dimensions"),
    (
        "dim-2**63",
        "tiny",
        patch("dim", "token_embd.weight", 2**63),
        r"tensor 'token_embd.weight' has a dimension of 9223372036854775808",
    ),
    ("key_len-2**63", "tiny", patch("key_len", "qwen3.block_count", 2**63), r"truncated: .*reading metadata key #\d+"),
    ("n_kv-2**60", "tiny", patch("n_kv", "GGUF.kv_count", 2**60), r"claims 1152921504606846976 metadata keys"),
    ("expert_count-0", "tiny-moe", replace("qwen3moe.expert_count", V.UINT32, 0), r"expert_count/expert_used_count"),
    (
        "expert_used_count-17",
        "tiny-moe",
        replace("qwen3moe.expert_used_count", V.UINT32, 17),
        r"expert_count/expert_used_count",
    ),
    (
        "expert_count-string",
        "tiny-moe",
        replace("qwen3moe.expert_count", V.STRING, "16"),
        r"'qwen3moe.expert_count' is the string '16', expected an integer",
    ),
    (
        "expert_count-2**32-1",
        "tiny-moe",
        replace("qwen3moe.expert_count", V.UINT32, 2**32 - 1),
        r"tensor 'blk.0.ffn_gate_inp.weight' has shape \[16, 256\], expected \[4294967295, 256\]",
    ),
    ("block_count-fewer", "tiny-moe", replace("qwen3moe.block_count", V.UINT32, 3), None),  # blk.3.* unused
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_targeted_variant(case, files, harness, tmp_path):
    name, preset, build, pattern = case
    src, lay = files[preset]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(build(lay, src.read_bytes()))
    msg = harness(name, path, preset == "tiny-moe", traced=True)
    if pattern is None:
        assert msg is None, f"{name}: {msg}"
    else:
        assert msg is not None, f"{name}: loaded"
        assert re.search(pattern, msg), msg


def test_huge_context_is_refused_before_allocating(files, harness, tmp_path):
    src, lay = files["tiny"]
    path = tmp_path / "ctx.gguf"
    path.write_bytes(replace("qwen3.context_length", V.UINT64, 2**40)(lay, src.read_bytes()))
    msg = harness("context_length 2**40 at -c 0", path, False, traced=True, n_ctx=0)
    assert msg and re.search(r"a context of 1099511627776 tokens needs .* more than the .* available", msg), msg


# ---- through the real command line ----
def test_cli_prints_one_error_line(files, tmp_path):
    src, lay = files["tiny"]
    orig = src.read_bytes()
    exe = Path(sys.executable).parent / "stream-run"
    runs = [
        ("inspect", orig[: lay.of("count", f"{TOK}.tokens")[0].off + 3], r"truncated"),
        ("inspect", patch("value", "qwen3.attention.head_count", 0)(lay, orig), r"bad model geometry"),
        ("run", replace("qwen3.block_count", V.STRING, "2")(lay, orig), r"expected an integer"),
        ("run", replace(f"{TOK}.merges", V.ARRAY, (V.STRING, ["a b", "abc"]))(lay, orig), r"BPE merge #1"),
        ("run", append(deep_nest(100_000))(lay, orig), r"nests arrays more than 8 deep"),
        (
            "inspect --json",
            replace(f"{TOK}.bos_token_id", V.ARRAY, (V.UINT32, [1, 2]))(lay, orig),
            rf"'{TOK}.bos_token_id' is an array",
        ),
    ]
    for i, (cmd, data, pattern) in enumerate(runs):
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(data)
        sub, *flags = cmd.split()
        args = [str(exe), sub, str(bad), *flags] + (["-p", "x", "-n", "1"] if sub == "run" else [])
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (cmd, pattern, r.stderr)
        assert re.search(pattern, lines[0]) and "Traceback" not in r.stdout + r.stderr, lines[0]
