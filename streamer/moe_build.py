"""Assemble the MoE FFN for a file and a RAM budget: resident when everything fits (or --no-stream), else a
streaming source over a budgeted cache with learned pins."""

from __future__ import annotations

import logging

from streamer.budget import split_budget
from streamer.errors import StreamerError
from streamer.experts.cache import ExpertCache, cache_slots
from streamer.experts.source import ResidentSource, StreamingSource
from streamer.experts.store import ExpertLayout
from streamer.experts.usage import Usage
from streamer.moe import MoEFFN
from streamer.options import StreamOptions
from streamer.trace import TraceRecorder, run_header
from streamer.traffic import ExpertTraffic

logger = logging.getLogger(__name__)


def build_moe_ffn(
    gf, cfg, options: StreamOptions, budget: int, n_ctx: int | None = None, trace=None, paged_in=lambda: 0
) -> MoEFFN:
    """budget: the run's RAM budget in bytes (budget.resolve). options.expert_cache_bytes overrides the budget plan (tests size the cache exactly). At most
    options.pin_share of the expert cache is pinned; the rest stays LRU. trace: a path to record the run's
    routing trace to (written when the session closes). paged_in: split_budget's (non-expert bytes a page-in
    started before the plan has mapped)."""
    stream, expert_cache_bytes = options.stream, options.expert_cache_bytes
    traffic = ExpertTraffic(cfg.n_layer)
    usage = Usage(gf, cfg.n_layer, cfg.n_expert, options.learn)
    layout = ExpertLayout(gf, cfg)
    plan = None
    kv = cfg.state_bytes(cfg.context(n_ctx), options.n_seq)
    if expert_cache_bytes is None and stream:
        plan = split_budget(budget, cfg, gf, layout.total_bytes, layout.slot_bytes, kv, paged_in)
        logger.info(plan.line())
        if plan.fits_resident:
            stream = False
            logger.info("all experts fit in the budget: using them in place (no streaming)")
        expert_cache_bytes = plan.expert_cache
    if not stream:
        source = ResidentSource(gf, cfg, traffic)
    else:
        n_slots, pin_cap, classes = cache_slots(
            expert_cache_bytes, layout.layer_slot_bytes, cfg.n_expert, cfg.n_expert_used, options.pin_share
        )
        if n_slots < cfg.n_expert_used:
            raise StreamerError(
                f"an expert cache of {expert_cache_bytes} bytes cannot hold one layer's "
                f"{cfg.n_expert_used} experts ({cfg.n_expert_used * layout.slot_bytes} bytes)"
            )
        cache = ExpertCache(
            n_slots, layout.slot_bytes, usage.pins(pin_cap), pin_cap, reserve=cfg.n_expert_used, classes=classes
        )
        source = StreamingSource(gf.files, layout, cache, traffic, n_readers=options.readers, direct=options.io.direct)
    ffn = MoEFFN(
        gf,
        cfg,
        source,
        traffic,
        usage,
        expert_top_p=options.expert_top_p,
        prefetch=options.prefetch,
        plan=plan,
        expert_skip=options.expert_skip,
    )
    if trace is not None:
        traffic.trace = ffn.router.trace = TraceRecorder(
            trace, run_header(gf, cfg, layout, ffn, plan, kv, options.pin_share, usage), usage.saved
        )
    return ffn
