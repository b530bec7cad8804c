"""/metrics in the Prometheus text format (version 0.0.4): request and token counters, speeds, the queue, and
the expert cache per layer from the traffic counters (hits by tier, demand and prefetch bytes, stall), live.
The format is a few lines of `name{labels} value`; written here rather than pulling in a client library."""

from __future__ import annotations

import psutil

from streamer.traffic import disk_read_bytes

P = "streamrun_"


class _Out:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help: str, samples) -> None:
        """samples: a value, or [(labels dict, value)]."""
        self.lines += [f"# HELP {P}{name} {help}", f"# TYPE {P}{name} {kind}"]
        if not isinstance(samples, list):
            samples = [({}, samples)]
        for labels, v in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            self.lines.append(f"{P}{name}{{{lab}}} {float(v):.6g}" if lab else f"{P}{name} {float(v):.6g}")


def render(engine, loaded: bool = True) -> str:
    o = _Out()
    o.metric("model_loaded", "gauge", "1 once the model is loaded.", int(loaded))
    o.metric("rss_bytes", "gauge", "Resident memory of the server process.", psutil.Process().memory_info().rss)
    o.metric("disk_read_bytes_total", "counter", "Bytes this process read from storage (psutil).", disk_read_bytes())
    if engine is None:
        return "\n".join(o.lines) + "\n"
    c = engine.counters
    o.metric(
        "requests_total",
        "counter",
        "Generation requests by outcome.",
        [({"outcome": k}, v) for k, v in c.requests.items()],
    )
    o.metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", c.prompt_tokens)
    o.metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the KV cache.", c.cached_tokens)
    o.metric("tokens_predicted_total", "counter", "Tokens generated.", c.completion_tokens)
    o.metric("prompt_seconds_total", "counter", "Time spent prefilling.", c.prompt_s)
    o.metric("tokens_predicted_seconds_total", "counter", "Time spent decoding.", c.gen_s)
    o.metric("prompt_tokens_per_second", "gauge", "Prefill speed of the last request.", c.last_prompt_tps)
    o.metric("predicted_tokens_per_second", "gauge", "Decode speed of the last request.", c.last_gen_tps)
    o.metric("queue_depth", "gauge", "Requests waiting for the worker.", engine.depth)
    o.metric("queue_size", "gauge", "Requests that may wait before new ones get 503.", engine.queue_size)
    o.metric("busy", "gauge", "1 while a generation runs.", int(engine.busy))
    active = engine.active
    o.metric(
        "slots",
        "gauge",
        "Sequence slots (--parallel) serving a request, and free.",
        [({"state": "busy"}, active), ({"state": "idle"}, len(engine.slots) - active)],
    )
    o.metric("batch_size", "gauge", "Sequences in the last decode step.", engine.batch_size)
    o.metric(
        "slot_tokens_per_second",
        "gauge",
        "Decode speed of the request each busy slot serves.",
        [({"slot": str(i)}, tps) for i, tps in engine.slot_speeds()],
    )
    o.metric(
        "kv_cache_tokens", "gauge", "Tokens held in the slots' KV caches.", sum(s.gen.state.n for s in engine.slots)
    )
    o.metric("context_size", "gauge", "Context size in tokens.", engine.n_ctx)
    _experts(o, engine.session)
    return "\n".join(o.lines) + "\n"


def _experts(o: _Out, session) -> None:
    traffic = session.traffic
    if traffic is None:
        return
    layers = traffic.layers

    def per_layer(name, help, get, kind="counter"):
        o.metric(name, kind, help, [({"layer": str(i)}, get(s)) for i, s in enumerate(layers)])

    o.metric(
        "expert_hits_total",
        "counter",
        "Expert requests served from the cache, by tier (prefetched: the "
        "first use of an expert a prefetch brought in).",
        [
            ({"layer": str(i), "tier": t}, getattr(s, f"hit_{t}"))
            for i, s in enumerate(layers)
            for t in ("pinned", "lru", "prefetched")
        ],
    )
    per_layer(
        "expert_requests_total", "Expert requests (one per distinct expert per layer call).", lambda s: s.requests
    )
    per_layer("expert_misses_total", "Expert requests served by a demand read.", lambda s: s.miss)
    per_layer("expert_demand_bytes_total", "Bytes of demand reads.", lambda s: s.read_bytes)
    per_layer("expert_prefetch_bytes_total", "Bytes of prefetch reads.", lambda s: s.prefetch_bytes)
    per_layer("expert_prefetch_issued_total", "Prefetch reads issued.", lambda s: s.prefetch_issued)
    per_layer("expert_prefetch_used_total", "Prefetched experts later used.", lambda s: s.prefetch_used)
    per_layer("expert_routed_total", "(token, expert) uses after top-k, expert top-p and skipping.", lambda s: s.routed)
    per_layer("expert_dropped_total", "Experts removed by expert top-p.", lambda s: s.dropped)
    per_layer(
        "expert_skipped_total",
        "(token, expert) uses skipped as neither cached nor read (--expert-skip).",
        lambda s: s.skipped,
    )
    per_layer(
        "expert_skipped_bytes_total", "Bytes of the experts skipping kept from being read.", lambda s: s.skipped_bytes
    )
    o.metric(
        "expert_shared_bytes_total",
        "counter",
        "Expert bytes that batched requests shared: uses served by an expert another sequence of the step read.",
        sum(s.shared_bytes for s in layers),
    )
    per_layer("expert_stall_seconds_total", "Time the compute thread waited for expert reads.", lambda s: s.stall_s)
    cache = getattr(session.moe.source, "cache", None)  # streaming only
    if cache is not None:
        o.metric(
            "expert_slots",
            "gauge",
            "Expert cache slots by state (in_use and reading are 0 between generations).",
            [({"state": k}, v) for k, v in cache.census().items()],
        )
        o.metric("expert_cache_bytes", "gauge", "Size of the expert cache.", cache.capacity_bytes)
