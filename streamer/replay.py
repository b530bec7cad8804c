"""`stream-run replay`: re-run the expert cache of a recorded routing trace offline, at other budgets and with
other eviction policies, without the model's weights or any reads.

The simulation is the runtime's own code, not a model of it: the budget plan (budget.split_at) and slot
arithmetic (experts/cache.cache_slots), the ExpertCache (tiers, reserve for demand reads, experts in use
never evicted; built without its arena), StreamingSource's request/prefetch/wait/release/drain, and
the MoE's scheduling loop (experts.source.serve: decode requests all, prefetches the lookahead set, waits,
releases; prefill keeps a window of requests), with reads replaced by futures that land at once (demand) or at the cache op clock the
trace recorded for that prefetch's landing (the median delay for prefetches the run did not issue).

Policies: lru (the runtime without pins), pinned-lru (the runtime: learned hot experts pinned, from the
run's usage profile if it had one, else from the trace itself), lfu (evicts the idle expert used least so
far), belady (offline optimal: evicts the idle expert whose next use is furthest away; demand reads only,
no pins, no prefetch: no policy, prefetching or not, can read fewer experts, so its hit rate is the
ceiling), per-layer (an LRU per layer with slot quotas: every layer gets a layer's worth of experts, then
each further slot goes to the layer whose miss curve, from the trace's replay, says it saves the most bytes;
in-sample, as the allocation is learned from the same trace)."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from streamer.budget import split_at
from streamer.errors import StreamerError
from streamer.experts.cache import ExpertCache, SlotClasses, cache_slots, grows
from streamer.experts.source import DEMAND, LRU, MISS, PINNED, PREFETCHED, StreamingSource, serve
from streamer.experts.usage import choose_pins
from streamer.io import human
from streamer.moe import apply_top_p
from streamer.trace import Trace, TraceRecorder
from streamer.traffic import ExpertTraffic

POLICIES = ("lru", "lfu", "pinned-lru", "belady", "per-layer")
DEFAULT_POLICIES = ("lru", "lfu", "pinned-lru", "belady")


@dataclass(frozen=True)
class ReplayOptions:
    budgets: tuple = (None,)  # RAM budgets in bytes; None: the recorded cache as it was
    policies: tuple = DEFAULT_POLICIES
    expert_top_p: float | None = None  # None: the run's
    prefetch: bool | None = None  # None: as the run had it (needs the recorded lookahead)


# ---- the simulated cache and source ----


class _SimFuture:
    __slots__ = ("land", "landed")

    def __init__(self, land=None):
        self.land, self.landed = land, land is None

    def done(self) -> bool:
        return self.landed

    def exception(self, timeout=None):
        if not self.landed:  # someone waits: the read lands now
            self.land()

    def result(self, timeout=None):
        return self.exception()


class _SimCache(ExpertCache):
    """ExpertCache without its arena, landing due prefetches before each op, as the clock recorded them."""

    def __init__(self, *args, **kw):
        super().__init__(*args, allocate=False, **kw)
        self.due: list = []
        self.seq = 0

    def _tick(self) -> None:
        while self.due and self.due[0][0] <= self.ops:
            heapq.heappop(self.due)[2].exception()

    def acquire(self, key, prefetch: bool = False, grow: bool = True):
        self._tick()
        return super().acquire(key, prefetch, grow)

    def release(self, e) -> None:
        self._tick()
        super().release(e)


class _Layout:
    def __init__(self, expert_bytes):
        self.sizes = [int(b) for b in expert_bytes]

    def expert_bytes(self, layer: int) -> int:
        return self.sizes[layer]


class _SimSource(StreamingSource):
    """StreamingSource's own request/prefetch/wait/release/drain over a _SimCache; no reader threads."""

    def __init__(self, layout, cache, traffic, delays: dict, default_delay: int):
        self.layout, self.cache, self.traffic = layout, cache, traffic
        self.delays, self.default_delay = delays, default_delay

    def _start(self, entry, priority: int) -> None:
        if priority == DEMAND:
            entry.future = _SimFuture()
            self.cache.loaded(entry)
            return
        fut = _SimFuture()

        def land():
            fut.landed = True
            self.cache.loaded(entry)

        fut.land, fut.landed = land, False
        entry.future = fut
        delay = self.delays.get((self.traffic.trace.call, entry.key[0], entry.key[1]), self.default_delay)
        self.cache.seq += 1
        heapq.heappush(self.cache.due, (self.cache.ops + delay, self.cache.seq, fut))


class _HeapIdle:
    """An idle tier that evicts the entry of lowest priority(key) (fixed when it became idle)."""

    def __init__(self, on_evict, priority):
        self.on_evict, self.priority = on_evict, priority
        self.d: dict = {}
        self.heap: list = []
        self.n = 0

    def __setitem__(self, key, entry) -> None:
        self.n += 1
        self.d[key] = (entry, self.n)
        heapq.heappush(self.heap, (self.priority(key), self.n, key))

    def pop(self, key, default=None):
        v = self.d.pop(key, None)
        return default if v is None else v[0]

    def popitem(self):
        while True:
            _, n, key = heapq.heappop(self.heap)
            v = self.d.get(key)
            if v is not None and v[1] == n:
                del self.d[key]
                self.on_evict(v[0])
                return key, v[0]

    def __len__(self) -> int:
        return len(self.d)

    def __contains__(self, key) -> bool:
        return key in self.d

    def __iter__(self):
        return iter(list(self.d))


class _SimRecorder(TraceRecorder):
    def __init__(self, header):
        super().__init__(None, header)
        self.counts: dict = defaultdict(int)

    def request(self, layer, e, tier, nbytes) -> None:
        super().request(layer, e, tier, nbytes)
        self.counts[(layer, e)] += 1


def _no_compute(start, group, mats) -> None:
    pass


# ---- routing under a top-p ----


def routed(trace: Trace, top_p: float) -> list:
    """Per call: (ids, w) after expert top-p `top_p`, recomputed from the recorded top-k weights."""
    rows = trace.call_rows()
    ids, w = apply_top_p(trace.a["r_ids"].astype(np.int64), trace.a["r_w"], top_p)
    return [(ids[rows[i] : rows[i + 1]], w[rows[i] : rows[i + 1]]) for i in range(trace.n_calls)]


def lookahead_sets(trace: Trace, top_p: float) -> dict:
    ids, _ = apply_top_p(trace.a["l_ids"].astype(np.int64), trace.a["l_w"], top_p)
    return {(int(s), int(layer)): row[row >= 0] for s, layer, row in zip(trace.a["l_step"], trace.a["l_layer"], ids)}


def usage_counts(trace: Trace, routes) -> np.ndarray:
    g = trace.geometry
    counts = np.zeros((g["n_layer"], g["n_expert"]))
    for layer, (ids, _) in zip(trace.a["c_layer"], routes):
        np.add.at(counts[layer], ids[ids >= 0], 1.0)
    return counts


def _request_sequence(trace: Trace, routes) -> tuple[dict, np.ndarray]:
    """Demand requests in order (each call's routed experts, ascending) -> the next position of the same key."""
    keys = []
    n_expert = trace.geometry["n_expert"]
    for layer, (ids, _) in zip(trace.a["c_layer"], routes):
        keys.extend((int(layer) * n_expert + np.unique(ids[ids >= 0])).tolist())
    nxt = np.full(len(keys), np.iinfo(np.int64).max, np.int64)
    seen: dict = {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = seen.get(keys[i], nxt[i])
        seen[keys[i]] = i
    return keys, nxt


def miss_curves(trace: Trace, routes) -> np.ndarray:
    """(n_layer, n_expert + 1): the misses of each layer's requests in an LRU holding c of that layer's experts,
    for every c (Mattson's stack distances, one pass)."""
    g = trace.geometry
    n_layer, n_expert = g["n_layer"], g["n_expert"]
    stacks = [[] for _ in range(n_layer)]
    hist = np.zeros((n_layer, n_expert + 2), np.int64)  # stack distance histogram; last column: first use
    for layer, (ids, _) in zip(trace.a["c_layer"], routes):
        st = stacks[layer]
        for e in np.unique(ids[ids >= 0]).tolist():
            if e in st:
                d = len(st) - st.index(e)  # 1 = most recent
                st.remove(e)
                hist[layer, d] += 1
            else:
                hist[layer, -1] += 1
            st.append(e)
    # misses at capacity c: first uses + requests at distance > c
    beyond = np.cumsum(hist[:, :-1][:, ::-1], axis=1)[:, ::-1]  # beyond[:, d] = requests at distance >= d
    c = np.arange(n_expert + 1)
    return hist[:, -1][:, None] + np.where(c + 1 <= n_expert, beyond[:, np.minimum(c + 1, n_expert)], 0)


def class_quotas(curves: np.ndarray, n_slots: int, expert_bytes, floor: int, classes) -> list[int]:
    """allocate's quotas, within each slot class over its own layers (a class's slots take its layers only)."""
    if classes is None:
        return allocate(curves, n_slots, expert_bytes, floor)
    q = [0] * len(expert_bytes)
    for c, n in enumerate(classes.n_slots):
        layers = [i for i, k in enumerate(classes.of_layer) if k == c]
        for i, v in zip(layers, allocate(curves[layers], n, [expert_bytes[i] for i in layers], floor)):
            q[i] = v
    return q


def allocate(curves: np.ndarray, n_slots: int, expert_bytes, floor: int) -> list[int]:
    """Slots per layer: each layer at least `floor` (a layer's experts are held together), then one slot at a
    time to the layer whose next slot saves the most bytes (misses saved x its expert size)."""
    n_layer, top = curves.shape[0], curves.shape[1] - 1
    q = [min(floor, n_slots // n_layer)] * n_layer
    left = n_slots - sum(q)
    heap = [(-(curves[i, q[i]] - curves[i, q[i] + 1]) * expert_bytes[i], i) for i in range(n_layer) if q[i] < top]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        q[i] += 1
        left -= 1
        if q[i] < top:
            heapq.heappush(heap, (-(curves[i, q[i]] - curves[i, q[i] + 1]) * expert_bytes[i], i))
    return q


def simulate(
    trace: Trace,
    n_slots: int,
    pins,
    pin_cap: int,
    policy: str,
    top_p: float,
    prefetch: bool,
    routes=None,
    classes: SlotClasses | None = None,
) -> dict:
    """Replay every recorded layer call through the runtime's cache code; the simulated run's trace arrays.
    classes: the cache's slot classes (cache_slots), None for slots of one size."""
    g, o = trace.geometry, trace.header["options"]
    n_layer, k = g["n_layer"], g["n_expert_used"]
    routes = routed(trace, top_p) if routes is None else routes
    prefetch = prefetch and policy != "belady"  # Belady is demand paging: it needs no prefetch to be optimal
    look = lookahead_sets(trace, top_p) if prefetch else {}
    a = trace.a
    landed = a["p_land"] >= 0
    delays = {
        (int(c), int(layer), int(e)): int(d)
        for c, layer, e, d in zip(
            a["p_call"][landed], a["p_layer"][landed], a["p_expert"][landed], (a["p_land"] - a["p_issue"])[landed]
        )
    }
    default_delay = int(np.median(list(delays.values()))) if delays else 0
    quotas = None
    if policy == "per-layer":
        quotas = class_quotas(miss_curves(trace, routes), n_slots, g["expert_bytes"], k, classes)
    cache = _SimCache(n_slots, g["slot_bytes"], pins, pin_cap, reserve=k, quotas=quotas, classes=classes)
    traffic = ExpertTraffic(n_layer)
    rec = traffic.trace = _SimRecorder(trace.header)
    if policy == "lfu":
        tick = iter(range(1 << 62))
        cache.idle = cache.per_class(lambda c: _HeapIdle(cache._evicted, lambda key: (rec.counts[key], next(tick))))
    elif policy == "belady":
        keys, nxt = _request_sequence(trace, routes)
        cache.idle = cache.per_class(lambda c: _HeapIdle(cache._evicted, lambda key: -int(nxt[rec.last_req[key]])))
    src = _SimSource(_Layout(g["expert_bytes"]), cache, traffic, delays, default_delay)
    allows = recorded_allowances(a, len(cache.frees))
    # as MoEFFN.roomy; Belady, the bound on hits, never evicts what a free slot could keep
    roomy = n_slots >= n_layer * g["n_expert"] or policy == "belady"
    for i, (step, layer, m) in enumerate(zip(a["c_step"], a["c_layer"], a["c_m"])):
        layer, m = int(layer), int(m)
        ids, w = routes[i]
        rec.call, rec.step = i, int(step)
        src.grow = grows(roomy, m, int(step))  # as MoEFFN._starting
        cache.allow = None if roomy else allows.get(i)  # as MoEFFN.__call__ and StreamingSource.limit_growth
        if cache.allow is not None:
            rec.allowed(cache.allow)
        used = ids >= 0
        experts = np.unique(ids[used])
        nxt_set = look.get((int(step), layer + 1)) if m == 1 and layer + 1 < n_layer else None
        if m == 1 and g["fused"][layer]:
            serve(src, layer, experts, _no_compute, prefetch_next=nxt_set)
        elif m > 1 and g["fused"][layer] and o.get("group"):  # grouped prefill (older traces: one at a time)
            serve(src, layer, experts, _no_compute, o["group"] + o["window"], nxt_set, o["group"])
        else:
            serve(src, layer, experts, _no_compute, o["window"], nxt_set)
    if policy == "belady" and rec.n_requests != len(keys):
        raise AssertionError("belady replay diverged from its request sequence")
    out = rec.arrays()
    out["quotas"] = quotas
    out["c_m"], out["c_seg"], out["c_layer"], out["c_step"] = a["c_m"], a["c_seg"], a["c_layer"], a["c_step"]
    return out


def recorded_allowances(a: dict, n_classes: int) -> dict[int, list[int]]:
    """Per call, the run's growth allowance per slot class (trace version 2); none where the trace has none or
    its classes are not the simulated cache's (a replay at another budget keeps the run's allowances when
    the classes match: the same machine faulting slots in at the same pace)."""
    if not len(a["a_class"]) or int(a["a_class"].max()) + 1 != n_classes:
        return {}
    out: dict = {}
    for call, c, n in zip(a["a_call"].tolist(), a["a_class"].tolist(), a["a_slots"].tolist()):
        out.setdefault(call, [0] * n_classes)[c] = n
    return out


# ---- statistics (the same function reads the live trace and a simulated one) ----


def traffic(a: dict, n_layer: int, calls: np.ndarray, expert_bytes=None) -> dict:
    """Hit rates and bytes over the layer calls selected by the boolean mask `calls`, overall and per layer."""
    qm = calls[a["q_call"]] if len(a["q_call"]) else np.zeros(0, bool)
    pm = calls[a["p_call"]] if len(a["p_call"]) else np.zeros(0, bool)
    q_layer = a["c_layer"][a["q_call"][qm]].astype(np.int64)
    tier = a["q_tier"][qm].astype(np.int64)
    by = np.zeros((n_layer, 4))
    np.add.at(by, (q_layer, tier), 1)
    dem = np.bincount(q_layer, weights=a["q_bytes"][qm].astype(np.float64), minlength=n_layer)
    pf = np.bincount(a["p_layer"][pm].astype(np.int64), weights=a["p_bytes"][pm].astype(np.float64), minlength=n_layer)
    stall = np.bincount(q_layer, weights=a["q_stall"][qm].astype(np.float64), minlength=n_layer)
    tokens = int(a["c_m"][calls & (a["c_layer"] == 0)].sum())
    req = by.sum(axis=1)

    def rate(x, n):
        return float(x / n) if n else None

    per_tok = max(tokens, 1)
    return {
        "tokens": tokens,
        "requests": int(req.sum()),
        "hit_rate": rate(by[:, PINNED].sum() + by[:, LRU].sum(), req.sum()),
        "prefetched_rate": rate(by[:, PREFETCHED].sum(), req.sum()),
        "miss_rate": rate(by[:, MISS].sum(), req.sum()),
        "read_bytes": float(dem.sum() + pf.sum()),
        "read_bytes_per_token": float((dem.sum() + pf.sum()) / per_tok),
        "demand_bytes_per_token": float(dem.sum() / per_tok),
        "stall_s": float(stall.sum()),
        "layers": {
            "hit_rate": [rate(by[i, PINNED] + by[i, LRU], req[i]) for i in range(n_layer)],
            "read_bytes_per_token": ((dem + pf) / per_tok).tolist(),
            "stall_s": stall.tolist(),
            "requests": req.astype(int).tolist(),
        },
    }


def scopes(a: dict) -> dict:
    """'all': every layer call; 'decode': one-token calls of the last segment of the traffic counters (a benchmark's decode
    phase; a run's decode steps)."""
    last = a["c_seg"].max() if len(a["c_seg"]) else 0
    return {"all": np.ones(len(a["c_m"]), bool), "decode": (a["c_m"] == 1) & (a["c_seg"] == last)}


def summarize(a: dict, n_layer: int) -> dict:
    return {name: traffic(a, n_layer, mask) for name, mask in scopes(a).items()}


def _resident(a: dict, n_layer: int) -> dict:
    """Everything fits: every request is a (pinned-tier) hit and nothing is read, as the runtime counts it."""
    r = dict(a)
    r["q_tier"] = np.full(len(a["q_tier"]), PINNED, np.int8)
    r["q_bytes"] = np.zeros(len(a["q_bytes"]), np.int64)
    r["p_call"] = r["p_layer"] = r["p_bytes"] = np.zeros(0, np.int64)
    return summarize(r, n_layer)


# ---- the replay ----


def recorded_policy(trace: Trace) -> str:
    cache = trace.header["cache"]
    return "pinned-lru" if cache and cache["pins"] else "lru"


def slots_at(p: dict, g: dict, budget: int, pin_share: float = 0.5) -> tuple[int, int, str | None, SlotClasses | None]:
    """(slots, pin capacity, None, slot classes) of the runtime's cache at this RAM budget, or (0, 0,
    'resident'/'too small', None): p is what the budget pays for besides the expert cache (a trace header's
    "plan"), g the geometry."""
    plan = split_at(budget, p["baseline"], p["nonexpert"], p["kv"], p["scratch"], p["expert_total"], p["slot_bytes"])
    if plan.fits_resident:
        return 0, 0, "resident", None
    if plan.expert_cache < g["n_expert_used"] * g["slot_bytes"]:
        return 0, 0, "too small", None
    n_slots, pin_cap, classes = cache_slots(
        plan.expert_cache, layer_slot_bytes(g), g["n_expert"], g["n_expert_used"], pin_share
    )
    return n_slots, pin_cap, None, classes


def layer_slot_bytes(g: dict) -> list[int]:
    """Each layer's slot size (traces before slot classes recorded only the largest)."""
    return g.get("layer_slot_bytes") or [g["slot_bytes"]] * g["n_layer"]


def recorded_classes(cache: dict) -> SlotClasses | None:
    c = cache.get("classes")
    return None if c is None else SlotClasses(*(tuple(c[k]) for k in SlotClasses._fields))


def replay(trace: Trace, opts: ReplayOptions, progress=None) -> dict:
    g, o = trace.geometry, trace.header["options"]
    n_layer = g["n_layer"]
    top_p = o["expert_top_p"] if opts.expert_top_p is None else opts.expert_top_p
    has_look = len(trace.a["l_step"]) > 0
    # a run with every expert resident stops the lookahead once all are touched: its record is partial
    prefetch = (o["prefetch"] and has_look and o["stream"]) if opts.prefetch is None else opts.prefetch
    if prefetch and not has_look:
        raise StreamerError(
            f"{trace.path}: the run recorded no lookahead sets (it ran without prefetch or "
            f"without streaming), so prefetch cannot be replayed (use --no-prefetch)"
        )
    for pol in opts.policies:
        if pol not in POLICIES:
            raise StreamerError(f"unknown policy {pol!r} (choose from {', '.join(POLICIES)})")
    routes = routed(trace, top_p)
    counts = trace.usage_saved if trace.usage_saved is not None else usage_counts(trace, routes)
    live = summarize(trace.a, n_layer)
    out = {
        "trace": trace.describe(),
        "header": trace.header,
        "expert_top_p": top_p,
        "prefetch": prefetch,
        "pins_from": "the run's usage profile" if trace.usage_saved is not None else "this trace",
        "live": live,
        "recorded": None,
        "results": [],
    }
    cache = trace.header["cache"]
    if cache is not None:
        sim = simulate(
            trace,
            cache["n_slots"],
            [tuple(p) for p in cache["pins"]],
            cache["pin_capacity"],
            recorded_policy(trace),
            top_p,
            prefetch,
            routes,
            recorded_classes(cache),
        )
        out["recorded"] = {
            "n_slots": cache["n_slots"],
            "policy": recorded_policy(trace),
            "replay": summarize(sim, n_layer),
        }
    jobs = [(b, pol) for b in opts.budgets for pol in opts.policies]
    for j, (b, pol) in enumerate(jobs):
        if progress is not None:
            progress(j, len(jobs))
        if b is None:
            if cache is None:
                out["results"].append(
                    {"budget": None, "policy": pol, "n_slots": 0, "state": "resident", **_resident(trace.a, n_layer)}
                )
                continue
            n_slots, pin_cap, state, classes = cache["n_slots"], cache["pin_capacity"], None, recorded_classes(cache)
        else:
            n_slots, pin_cap, state, classes = slots_at(trace.header["plan"], g, b, o["pin_share"])
        row = {"budget": b, "policy": pol, "n_slots": n_slots, "state": state}
        if state == "resident":
            row.update(_resident(trace.a, n_layer))
        elif state is None:
            pins = choose_pins(counts, pin_cap) if pol == "pinned-lru" else []
            pf = prefetch and pol != "belady"
            row.update(summarize(simulate(trace, n_slots, pins, pin_cap, pol, top_p, pf, routes, classes), n_layer))
        out["results"].append(row)
    if progress is not None:
        progress(len(jobs), len(jobs))
    return out


# ---- text ----


def _pct(v) -> str:
    return "   n/a" if v is None else f"{100 * v:5.1f}%"


def format_replay(r: dict, per_layer: bool = False) -> str:
    how = (
        f"replayed with expert top-p {r['expert_top_p']:g}, prefetch {'on' if r['prefetch'] else 'off'}; "
        f"pinned-lru pins from {r['pins_from']}; hit = served by the pinned or LRU tier (prefetched uses and "
        f"demand reads are not hits); MiB/token counts demand and prefetch reads"
    )
    lines = [r["trace"], how]
    skip = r["header"]["options"].get("expert_skip", 0.0)
    if skip > 0:
        lines.append(
            f"the run skipped uncached experts (--expert-skip {skip:g}); the replay does not: it reads every routed "
            "expert, so its misses and MiB/token are above the run's"
        )
    if r["recorded"] is not None:
        rec = r["recorded"]
        lines.append(f"as recorded ({rec['n_slots']} slots, {rec['policy']}): live vs replay")
        for scope in ("decode", "all"):
            lv, rp = r["live"][scope], rec["replay"][scope]
            if not lv["requests"]:
                continue
            mib = f"{lv['read_bytes_per_token'] / 2**20:.2f} vs {rp['read_bytes_per_token'] / 2**20:.2f} MiB/token"
            lines.append(
                f"  {scope:<6} hit {_pct(lv['hit_rate'])} vs {_pct(rp['hit_rate'])}, prefetched "
                f"{_pct(lv['prefetched_rate'])} vs {_pct(rp['prefetched_rate'])}, {mib}"
            )
    lines.append(
        f"{'budget':>10} {'slots':>6} {'policy':<11} {'decode hit':>10} {'pref':>6} {'miss':>6} "
        f"{'MiB/tok':>8} {'all hit':>8} {'MiB/tok':>8}"
    )
    for row in r["results"]:
        b = "recorded" if row["budget"] is None else human(row["budget"])
        if row["state"] == "too small":
            lines.append(f"{b:>10} {'-':>6} {row['policy']:<11} too small: cannot hold one layer's experts")
            continue
        d, al = row["decode"], row["all"]
        slots = "all" if row["state"] == "resident" else str(row["n_slots"])
        lines.append(
            f"{b:>10} {slots:>6} {row['policy']:<11} {_pct(d['hit_rate']):>10} {_pct(d['prefetched_rate'])} "
            f"{_pct(d['miss_rate'])} {d['read_bytes_per_token'] / 2**20:8.2f} {_pct(al['hit_rate']):>8} "
            f"{al['read_bytes_per_token'] / 2**20:8.2f}"
        )
    if per_layer:
        rows = [row for row in r["results"] if row["state"] != "too small"]
        n_layer = r["header"]["geometry"]["n_layer"]
        head = "layer " + " ".join(
            f"{('rec' if x['budget'] is None else human(x['budget'])) + ' ' + x['policy']:>20}" for x in rows
        )
        lines += ["", "per layer, decode steps: hit rate / MiB read per token", head]
        for i in range(n_layer):
            cells = []
            for x in rows:
                d = x["decode"]["layers"]
                cells.append(f"{_pct(d['hit_rate'][i])} / {d['read_bytes_per_token'][i] / 2**20:7.2f}".rjust(20))
            lines.append(f"{i:>5} " + " ".join(cells))
    return "\n".join(lines)
