"""Routing traces: what a run asked of its experts, step by step, written beside ExpertTraffic's counts so that
`stream-run replay` can re-run the expert cache offline at other budgets and policies.

A trace is one .npz (numpy arrays, zip-compressed, written atomically) holding a JSON header (format name and
version, the model's identity: file name, size and header hash; the geometry: layers, experts, per-layer
expert bytes, slot size; the run's budget plan, cache slots, pins and options) and flat arrays:
- calls: one row per MoE layer call (forward step, layer, tokens, traffic segment);
- routes: per token of each call, the top-k expert ids and router weights before expert top-p, and the
  weights after it (dropped experts: weight 0);
- lookahead: per decode step and layer, the router lookahead's top-k ids and weights (the prefetch sets);
- requests: per expert request, its call, expert, how it was served (pinned, LRU, prefetched, demand read),
  bytes read and time stalled waiting for it;
- prefetches: per prefetch issued, its call, layer, expert, bytes, and the cache's op clock (acquire and
  release calls so far) when it was issued and when its read landed, which replays prefetch timing exactly;
- allowances: per decode call and slot class, the never-used slots the cache could grow into (ExpertCache.allow:
  as many as its prefault threads had faulted in), which replays its growth exactly (version 2; none in 1).

Recording appends a few small arrays or ints per layer call and request: the same places ExpertTraffic
counts, nothing per element."""

from __future__ import annotations

import hashlib
import json
import threading
import zipfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from streamer.budget import scratch_bytes
from streamer.errors import StreamerError
from streamer.gguf_file import model_key
from streamer.io import atomic_write

FORMAT = "stream-run-trace"
VERSION = 2  # 2: the allowances
TIERS = ("pinned", "lru", "prefetched", "miss")  # the codes of streamer.experts.source: PINNED, LRU, ...

# array name -> (dtype, trailing shape: "k" for n_expert_used columns)
ARRAYS = {
    "c_step": ("i4", ()),
    "c_layer": ("i2", ()),
    "c_m": ("i4", ()),
    "c_seg": ("i2", ()),
    "r_ids": ("i2", ("k",)),
    "r_w": ("f4", ("k",)),
    "r_wp": ("f4", ("k",)),
    "l_step": ("i4", ()),
    "l_layer": ("i2", ()),
    "l_ids": ("i2", ("k",)),
    "l_w": ("f4", ("k",)),
    "q_call": ("i4", ()),
    "q_expert": ("i2", ()),
    "q_tier": ("i1", ()),
    "q_bytes": ("i8", ()),
    "q_stall": ("f4", ()),
    "p_call": ("i4", ()),
    "p_layer": ("i2", ()),
    "p_expert": ("i2", ()),
    "p_bytes": ("i8", ()),
    "p_issue": ("i8", ()),
    "p_land": ("i8", ()),
    "a_call": ("i4", ()),
    "a_class": ("i2", ()),
    "a_slots": ("i4", ()),
}
ARRAY_CODES = {"i1": "b", "i2": "h", "i4": "i", "i8": "q", "f4": "f"}  # the array module's type codes
GROUPS = {"c": "calls", "r": "routes", "l": "lookahead", "q": "requests", "p": "prefetches", "a": "allowances"}


def run_header(gf, cfg, layout, ffn, plan, kv_bytes: int, pin_share: float, usage) -> dict:
    """Everything a replay needs besides the arrays: the model's identity and geometry and the run's setup."""
    cache = getattr(ffn.source, "cache", None)
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    # what the budget pays for besides the expert cache: the run's own plan, or (a cache sized directly, or
    # --no-stream) the same parts as the plan would count them now
    base = plan.baseline if plan is not None else psutil.Process().memory_info().rss
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {"file": Path(gf.path).name, "size": gf.size, "key": model_key(gf)},
        "geometry": {
            "n_layer": cfg.n_layer,
            "n_expert": cfg.n_expert,
            "n_expert_used": cfg.n_expert_used,
            "expert_bytes": [layout.expert_bytes(i) for i in range(cfg.n_layer)],
            "slot_bytes": layout.slot_bytes,
            "layer_slot_bytes": layout.layer_slot_bytes,
            "fused": [f is not None for f in ffn.fused],
        },
        "plan": {
            "budget": plan.budget if plan is not None else None,
            "baseline": base,
            "nonexpert": nonexpert,
            "kv": kv_bytes,
            "scratch": scratch_bytes(cfg),
            "expert_total": layout.total_bytes,
            "slot_bytes": layout.slot_bytes,
        },
        "cache": None
        if cache is None
        else {
            "n_slots": cache.n_slots,
            "classes": None if not cache.of_layer else {k: list(v) for k, v in cache.classes._asdict().items()},
            "pin_capacity": cache.pin_capacity,
            "reserve": cache.reserve,
            "pins": sorted([int(a), int(b)] for a, b in cache.pin_set),
        },
        "options": {
            "expert_top_p": ffn.expert_top_p,
            "expert_skip": ffn.expert_skip,  # replay does not model it: it replays the routes before skipping
            "prefetch": bool(ffn.prefetch),
            "stream": cache is not None,
            "pin_share": pin_share,
            "window": ffn.tuning.window,
            "group": ffn.tuning.group,  # a streamed prefill computes this many experts together, window ahead of them
        },
        "usage_saved": usage.saved is not None,
    }


class TraceRecorder:
    """Appends to flat typed buffers (array/bytearray: C copies, no per-element Python and no Python object
    per record): about 20 KB per decoded token on the 30B-A3B geometry, held until the trace is written."""

    def __init__(self, path, header: dict, usage_saved: np.ndarray | None = None):
        self.path, self.header = (None if path is None else Path(path)), header
        self.lock = threading.Lock()  # landings are recorded from the reader threads
        self.step, self.call, self.segment = -1, -1, 0
        self.buf = {n: array(ARRAY_CODES[dt]) for n, (dt, shape) in ARRAYS.items() if not shape}
        self.raw = {n: bytearray() for n, (dt, shape) in ARRAYS.items() if shape}  # (rows, k) arrays
        self.last_req: dict = {}
        self.last_pf: dict = {}
        self.usage_saved = usage_saved

    # ---- hooks (moe.py and experts/source.py call these where ExpertTraffic counts) ----
    def route(self, layer: int, ids_k: np.ndarray, w_k: np.ndarray, w: np.ndarray) -> None:
        if layer == 0:
            self.step += 1
        self.call += 1
        b = self.buf
        b["c_step"].append(self.step)
        b["c_layer"].append(layer)
        b["c_m"].append(len(ids_k))
        b["c_seg"].append(self.segment)
        self.raw["r_ids"] += ids_k.astype(np.int16).tobytes()
        self.raw["r_w"] += w_k.astype(np.float32).tobytes()
        self.raw["r_wp"] += w.astype(np.float32).tobytes()

    def lookahead(self, layer: int, ids_k: np.ndarray, w_k: np.ndarray) -> None:
        """The lookahead for `layer` runs before that step's layer-0 FFN when layer is 1."""
        self.buf["l_step"].append(self.step + (layer == 1))
        self.buf["l_layer"].append(layer)
        self.raw["l_ids"] += ids_k.astype(np.int16).tobytes()
        self.raw["l_w"] += w_k.astype(np.float32).tobytes()

    @property
    def n_requests(self) -> int:
        return len(self.buf["q_call"])

    def request(self, layer: int, e: int, tier: int, nbytes: int) -> None:
        b = self.buf
        self.last_req[(layer, e)] = len(b["q_call"])
        b["q_call"].append(self.call)
        b["q_expert"].append(e)
        b["q_tier"].append(tier)
        b["q_bytes"].append(nbytes)
        b["q_stall"].append(0.0)

    def stall(self, layer: int, e: int, seconds: float) -> None:
        i = self.last_req.get((layer, e))
        if i is not None:
            self.buf["q_stall"][i] += seconds

    def prefetched(self, layer: int, e: int, nbytes: int, clock: int) -> None:
        with self.lock:
            b = self.buf
            self.last_pf[(layer, e)] = len(b["p_call"])
            for name, v in (
                ("p_call", self.call),
                ("p_layer", layer),
                ("p_expert", e),
                ("p_bytes", nbytes),
                ("p_issue", clock),
                ("p_land", -1),
            ):
                b[name].append(v)

    def landed(self, layer: int, e: int, clock: int) -> None:
        with self.lock:
            i = self.last_pf.pop((layer, e), None)
            if i is not None:
                self.buf["p_land"][i] = clock

    def allowed(self, slots) -> None:
        """This call's growth allowance, per slot class (StreamingSource.limit_growth)."""
        b = self.buf
        for c, n in enumerate(slots):
            b["a_call"].append(self.call)
            b["a_class"].append(c)
            b["a_slots"].append(n)

    def reset(self) -> None:
        """The traffic counters were reset (a benchmark's phases): later calls belong to the next segment."""
        self.segment += 1

    # ---- output ----
    def arrays(self) -> dict:
        k = self.header["geometry"]["n_expert_used"]
        with self.lock:
            out = {n: np.array(v, dtype=ARRAYS[n][0]) for n, v in self.buf.items()}
            out.update({n: np.frombuffer(bytes(v), ARRAYS[n][0]).reshape(-1, k) for n, v in self.raw.items()})
        return {name: out[name] for name in ARRAYS}

    def save(self) -> None:
        save_trace(self.path, self.header, self.arrays(), self.usage_saved)


def digest(arrays: dict) -> str:
    """sha256 over every array's name, type, shape and bytes: the header carries it, so any damage shows."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        x = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{x.dtype.str}:{x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def save_trace(path, header: dict, arrays: dict, usage_saved: np.ndarray | None = None) -> None:
    extra = {} if usage_saved is None else {"usage_saved": np.asarray(usage_saved, np.float64)}
    header = {**header, "digest": digest({**arrays, **extra})}
    blob = np.frombuffer(json.dumps(header).encode(), np.uint8)
    atomic_write(path, lambda f: np.savez_compressed(f, header=blob, **arrays, **extra))


@dataclass
class Trace:
    path: Path
    header: dict
    a: dict  # the arrays
    usage_saved: np.ndarray | None

    @property
    def geometry(self) -> dict:
        return self.header["geometry"]

    @property
    def n_calls(self) -> int:
        return len(self.a["c_step"])

    def call_rows(self) -> np.ndarray:
        """Offset of each call's first route row (and the total at the end)."""
        return np.concatenate([[0], np.cumsum(self.a["c_m"])])

    def describe(self) -> str:
        g, m, o = self.geometry, self.header["model"], self.header["options"]
        cache = self.header["cache"]
        where = f"{cache['n_slots']} slots, {len(cache['pins'])} pinned" if cache else "experts resident"
        steps = int(self.a["c_step"].max()) + 1 if self.n_calls else 0
        return (
            f"trace {self.path.name}: {m['file']} ({m['size']} bytes), {g['n_layer']} layers x {g['n_expert']} "
            f"experts ({g['n_expert_used']} used); recorded with {where}, prefetch "
            f"{'on' if o['prefetch'] else 'off'}, expert top-p {o['expert_top_p']:g}; {steps} steps, "
            f"{len(self.a['q_call'])} expert requests"
        )


def _bad(path, why: str) -> StreamerError:
    return StreamerError(f"{path} is not a usable stream-run trace: {why}")


def load_trace(path) -> Trace:
    """Read and check a trace; any problem is one StreamerError line (corrupt, truncated, newer version)."""
    path = Path(path)
    if not path.is_file():
        raise StreamerError(f"no such trace file: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "header" not in z.files:
                raise _bad(path, "no header (not written by stream-run --trace?)")
            header = json.loads(z["header"].tobytes().decode())
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise _bad(path, "not a stream-run trace")
            version = header.get("version")
            if not isinstance(version, int) or version < 1:
                raise _bad(path, f"bad version {version!r}")
            if version > VERSION:
                raise StreamerError(
                    f"{path} is a version {version} trace, written by a newer stream-run; this one "
                    f"reads version {VERSION} (upgrade stream-run)"
                )
            wanted = [n for n in ARRAYS if version > 1 or not n.startswith("a_")]  # version 1: no allowances
            missing = [n for n in wanted if n not in z.files]
            if missing:
                raise _bad(path, f"missing arrays {', '.join(missing)}")
            arrays = {n: z[n] for n in wanted}
            usage = z["usage_saved"] if "usage_saved" in z.files else None
            if header.get("digest") != digest({**arrays, **({} if usage is None else {"usage_saved": usage})}):
                raise _bad(path, "corrupt or truncated (its arrays do not match the header's checksum)")
            arrays.update({n: np.zeros(0, ARRAYS[n][0]) for n in ARRAYS if n not in arrays})
    except StreamerError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise _bad(path, f"corrupt or truncated ({type(e).__name__}: {e})") from None
    trace = Trace(path, header, arrays, usage)
    try:
        _check(trace)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _bad(path, f"inconsistent contents ({type(e).__name__}: {e})") from None
    return trace


def _check(t: Trace) -> None:
    h, a = t.header, t.a
    g = h["geometry"]
    n_layer, n_expert, k = int(g["n_layer"]), int(g["n_expert"]), int(g["n_expert_used"])
    if not (0 < k <= n_expert and n_layer > 0) or len(g["expert_bytes"]) != n_layer or len(g["fused"]) != n_layer:
        raise ValueError("bad geometry")
    if int(g["slot_bytes"]) < max(int(b) for b in g["expert_bytes"]):
        raise ValueError("slot smaller than an expert")
    slots = g.get("layer_slot_bytes")
    if slots is not None and (len(slots) != n_layer or any(int(s) < int(b) for s, b in zip(slots, g["expert_bytes"]))):
        raise ValueError("bad layer_slot_bytes")
    for grp, what in GROUPS.items():
        lengths = {len(a[n]) for n in ARRAYS if n.startswith(grp + "_")}
        if len(lengths) != 1:
            raise ValueError(f"{what} arrays differ in length")
    for n, (dt, shape) in ARRAYS.items():
        want = tuple(k if s == "k" else s for s in shape)
        if a[n].dtype != np.dtype(dt) or a[n].shape[1:] != want:
            raise ValueError(f"array {n} has type {a[n].dtype} shape {a[n].shape}")
    n_calls = len(a["c_m"])
    if (a["c_m"] < 1).any() or int(a["c_m"].sum()) != len(a["r_ids"]):
        raise ValueError("call sizes do not add up to the routes")
    if ((a["c_layer"] < 0) | (a["c_layer"] >= n_layer)).any() or ((a["l_layer"] < 1) | (a["l_layer"] >= n_layer)).any():
        raise ValueError("layer out of range")
    for n in ("r_ids", "l_ids"):
        if ((a[n] < 0) | (a[n] >= n_expert)).any():
            raise ValueError(f"expert id out of range in {n}")
    for n in ("q_expert", "p_expert"):
        if ((a[n] < 0) | (a[n] >= n_expert)).any():
            raise ValueError(f"expert id out of range in {n}")
    for n in ("q_call", "p_call", "a_call"):
        if ((a[n] < 0) | (a[n] >= n_calls)).any():
            raise ValueError(f"call index out of range in {n}")
    if (a["a_class"] < 0).any() or (a["a_slots"] < 0).any():
        raise ValueError("bad allowance")
    if ((a["q_tier"] < 0) | (a["q_tier"] >= len(TIERS))).any():
        raise ValueError("bad tier code")
    if not (np.all(np.isfinite(a["r_w"])) and np.all(np.isfinite(a["r_wp"])) and np.all(np.isfinite(a["l_w"]))):
        raise ValueError("non-finite weights")
    if n_calls and (np.diff(a["c_step"]) < 0).any():
        raise ValueError("steps out of order")
    if t.usage_saved is not None and t.usage_saved.shape != (n_layer, n_expert):
        raise ValueError("usage profile of the wrong shape")
    for key in ("budget", "baseline", "nonexpert", "kv", "scratch", "expert_total", "slot_bytes"):
        v = h["plan"][key]
        if v is not None and (not isinstance(v, int) or v < 0):
            raise ValueError(f"plan.{key}")
    o = h["options"]
    if not (0.0 < float(o["expert_top_p"]) <= 1.0):
        raise ValueError("expert_top_p")
    cache = h["cache"]
    if cache is not None:
        if not (k <= int(cache["n_slots"]) <= n_layer * n_expert):
            raise ValueError("n_slots")
        cls = cache.get("classes")
        if cls is not None and (
            len(cls["of_layer"]) != n_layer
            or sum(cls["n_slots"]) != cache["n_slots"]
            or not all(0 <= c < len(cls["n_slots"]) == len(cls["slot_bytes"]) for c in cls["of_layer"])
        ):
            raise ValueError("bad slot classes")
        for layer, e in cache["pins"]:
            if not (0 <= layer < n_layer and 0 <= e < n_expert):
                raise ValueError("pin out of range")


def check_model(trace: Trace, gf) -> None:
    """The trace must be of this very model (header hash and size), or one error line."""

    m = trace.header["model"]
    if m.get("key") != model_key(gf) or m.get("size") != gf.size:
        raise StreamerError(
            f"{trace.path} is a trace of another model ({m.get('file')}, {m.get('size')} bytes), "
            f"not of {Path(gf.path).name}"
        )
