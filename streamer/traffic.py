"""Per-layer expert traffic: hits by tier, misses, bytes requested, prefetch issued/used/wasted and recall,
time stalled on I/O; with the process's real disk reads (psutil) beside our own byte counts."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import psutil


def disk_read_bytes() -> int:
    try:
        return psutil.Process().io_counters().read_bytes
    except (psutil.Error, AttributeError):  # not available on every platform
        return 0


@dataclass
class LayerStats:
    routed: int = 0  # (token, expert) uses after top-k / top-p
    requests: int = 0  # expert requests: one per distinct expert per layer call (what hits and misses add up to)
    hit_pinned: int = 0
    hit_lru: int = 0
    hit_prefetched: int = 0  # first use of an expert a prefetch brought in (or had in flight)
    miss: int = 0  # demand reads
    dropped: int = 0  # experts removed by expert top-p (never read)
    tokens: int = 0  # tokens routed (each one's routing weight is a share of 1)
    skipped: int = 0  # (token, expert) uses removed by expert skipping (--expert-skip)
    skipped_share: float = 0.0  # their shares of their tokens' routing weight, summed
    skipped_bytes: int = 0  # bytes of the experts skipping kept from being read
    read_bytes: int = 0  # bytes requested by demand reads
    prefetch_issued: int = 0
    prefetch_bytes: int = 0
    prefetch_used: int = 0
    calls: int = 0  # layer calls (a decode step or a prompt chunk): requests / calls is the distinct experts per call
    shared: int = 0  # (token, expert) uses of a batched decode step served by an expert another sequence reads
    shared_bytes: int = 0  # the bytes those uses would have asked for alone
    recall_hit: int = 0  # |predicted ∩ routed| summed over decode steps
    recall_total: int = 0  # |routed| summed over the same steps
    stall_s: float = 0.0  # compute thread waiting for reads

    @property
    def hits(self) -> int:
        """Uses served from the cache without a read started for them: pinned or LRU (prefetches not counted)."""
        return self.hit_pinned + self.hit_lru

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class ExpertTraffic:
    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.trace = None  # a streamer.trace.TraceRecorder when the run records a routing trace
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (e.g. between the prefill and decode phases of a benchmark)."""
        self.layers = [LayerStats() for _ in range(self.n_layer)]
        self.t0 = time.perf_counter()
        self.disk0 = disk_read_bytes()
        self.tokens = 0  # tokens run through the model (prefill + decode)
        if self.trace is not None:
            self.trace.reset()

    def routed(self, layer: int, ids: np.ndarray, predicted: np.ndarray | None = None, skipped: int = 0) -> None:
        """Count one routing decision of `layer`: ids (m tokens, k) with -1 for experts dropped by expert top-p
        or skipped (`skipped` of them); for one token, how many of its experts the lookahead had predicted."""
        st = self.layers[layer]
        st.calls += 1
        st.tokens += ids.shape[0]
        st.dropped -= skipped
        if ids.shape[0] == 1:  # decode: a handful of ids, cheaper in Python than in numpy calls
            row = [e for e in ids[0].tolist() if e >= 0]
            st.routed += len(row)
            st.dropped += ids.shape[1] - len(row)
            if predicted is not None:
                st.recall_hit += len(set(row).intersection(predicted.tolist()))
                st.recall_total += len(row)
        else:
            used = ids >= 0
            st.routed += int(used.sum())
            st.dropped += int((~used).sum())
            if predicted is not None:  # a batched decode step: the union the lookahead read ahead
                union = np.unique(ids[used])
                st.recall_hit += int(np.isin(union, predicted).sum())
                st.recall_total += len(union)
        if layer == 0:
            self.tokens += ids.shape[0]

    def shared(self, layer: int, n: int, nbytes: int) -> None:
        """Count a batched decode step's sharing in one layer call: n uses served by an expert that another
        sequence of the step also reads, worth nbytes had each sequence read its own."""
        st = self.layers[layer]
        st.shared += n
        st.shared_bytes += nbytes

    def skipped(self, layer: int, n: int, share: float, nbytes: int) -> None:
        """Count expert skipping's drops in one layer call: n uses, their routing-weight shares summed, and the
        bytes of the experts it kept from being read."""
        st = self.layers[layer]
        st.skipped += n
        st.skipped_share += share
        st.skipped_bytes += nbytes

    def totals(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers:
            t.add(s)
        return t

    def report(self) -> dict:
        t = self.totals()
        wall = time.perf_counter() - self.t0
        return {
            "tokens": self.tokens,
            "wall_s": wall,
            "hit_rate": t.hits / t.requests if t.requests else None,  # already cached when requested
            "prefetched_rate": t.hit_prefetched / t.requests if t.requests else None,  # brought in by prefetch
            "miss_rate": t.miss / t.requests if t.requests else None,  # demand reads
            "read_bytes": t.read_bytes + t.prefetch_bytes,
            "read_bytes_per_token": (t.read_bytes + t.prefetch_bytes) / max(self.tokens, 1),
            "disk_read_bytes": disk_read_bytes() - self.disk0,
            "prefetch_recall": t.recall_hit / t.recall_total if t.recall_total else None,
            "prefetch_wasted": t.prefetch_issued - t.prefetch_used,
            "stall_share": t.stall_s / wall if wall > 0 else 0.0,
            "skipped_weight_share": t.skipped_share / t.tokens if t.tokens else 0.0,  # of all routing weight
            "skipped_bytes_per_token": t.skipped_bytes / max(self.tokens, 1),
            "experts_per_call": t.requests / t.calls if t.calls else None,  # distinct experts per layer call
            "shared_bytes": t.shared_bytes,  # expert bytes a batched step's sequences shared (read once, used twice+)
            "totals": asdict(t),
            "layers": [asdict(s) for s in self.layers],
        }

    def summary(self) -> str:
        r = self.report()

        def pct(v):
            return "n/a" if v is None else f"{100 * v:.1f}%"

        rec = pct(r["prefetch_recall"])
        t = r["totals"]
        skip = ""
        if t["skipped"]:
            skip = (
                f"; skipped {t['skipped']} routed experts ({pct(r['skipped_weight_share'])} of the routing weight, "
                f"{r['skipped_bytes_per_token'] / 2**20:.1f} MiB/token not read)"
            )
        return (
            f"experts: hit rate {pct(r['hit_rate'])} (prefetched {pct(r['prefetched_rate'])}, demand reads "
            f"{pct(r['miss_rate'])}), {r['read_bytes_per_token'] / 2**20:.1f} MiB read/token "
            f"(disk {r['disk_read_bytes'] / 2**20:.0f} MiB total), prefetch recall {rec}, "
            f"I/O stall {100 * r['stall_share']:.0f}% of wall time{skip}"
        )

    def table(self) -> str:
        """routed: (token, expert) uses; reqs: distinct experts asked for per layer call, which are served as
        pinned / LRU hits, prefetched, or demand-read (miss)."""
        head = (
            f"{'layer':>5} {'routed':>7} {'reqs':>6} {'pinned':>7} {'lru':>7} {'prefet':>7} {'miss':>7} {'drop':>6} {'skip':>6} "
            f"{'MiB read':>9} {'pf iss':>7} {'pf used':>7} {'recall':>7} {'stall s':>8}"
        )
        rows = [head]
        for i, s in enumerate(self.layers + [self.totals()]):
            rec = f"{100 * s.recall_hit / s.recall_total:6.1f}%" if s.recall_total else f"{'-':>7}"
            name = "all" if i == len(self.layers) else str(i)
            rows.append(
                f"{name:>5} {s.routed:>7} {s.requests:>6} {s.hit_pinned:>7} {s.hit_lru:>7} {s.hit_prefetched:>7} {s.miss:>7} "
                f"{s.dropped:>6} {s.skipped:>6} {(s.read_bytes + s.prefetch_bytes) / 2**20:>9.1f} {s.prefetch_issued:>7} "
                f"{s.prefetch_used:>7} {rec} {s.stall_s:>8.3f}"
            )
        return "\n".join(rows)
