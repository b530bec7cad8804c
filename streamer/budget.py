"""The RAM budget: what is resident is paid for first (the process as it stands, non-expert weights, KV
cache, scratch, a safety margin); what remains is the expert cache. The OS page cache counts too, which is
why expert reads bypass it (see experts/store.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from streamer.errors import StreamerError
from streamer.io import human

logger = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.8  # of available memory, when no --ram-budget is given
# ... or this much when the whole model fits in it: it then runs in place from the page cache, as llama.cpp's
# mmap does (2026-12-05: 10.1 tok/s in place against 2.2 streamed through 0.8, for a 19.65 GiB file in 24 GiB)
ROOMY_FRACTION = 0.95


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v1 or v2), or None if unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if ctrls == "" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
            fname = f"/sys/fs/cgroup{path}/memory.max"
        elif "memory" in ctrls.split(","):
            fname = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(fname) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text != "max" and int(text) < 2**60:
            return int(text)
    return None


def available_memory() -> int:
    """Memory this process may still use: the system's available memory, capped by its cgroup's limit."""
    avail = psutil.virtual_memory().available
    limit = cgroup_limit()
    return avail if limit is None else min(avail, limit)


def resolve(ram_budget: int | None) -> int:
    """The run's RAM budget in bytes: the one given (StreamOptions parsed its text), else DEFAULT_FRACTION of
    the memory available now. open_model calls this once and hands the figure down (the CLI's early page-in,
    a hint before the options are parsed, calls it for its own check)."""
    return int(DEFAULT_FRACTION * available_memory()) if ram_budget is None else int(ram_budget)


def roomy(budget: int, fits_at: Callable[[int], bool]) -> int:
    """The default budget (no --ram-budget) raised to ROOMY_FRACTION of available memory when the model fits
    whole at that figure (fits_at(budget) says), else unchanged."""
    wide = int(ROOMY_FRACTION * available_memory())
    return wide if wide > budget and fits_at(wide) else budget


@dataclass(frozen=True)
class BudgetSplit:
    budget: int
    baseline: int  # process RSS before the model's memory
    nonexpert: int
    kv: int
    scratch: int
    margin: int
    expert_total: int  # all experts of the file
    slot_bytes: int

    @property
    def expert_cache(self) -> int:
        return self.budget - self.baseline - self.nonexpert - self.kv - self.scratch - self.margin

    @property
    def fits_resident(self) -> bool:
        """Everything, experts included, fits: no reason to stream."""
        return self.expert_cache >= self.expert_total

    def line(self) -> str:
        return (
            f"RAM budget {human(self.budget)}: process {human(self.baseline)}, non-expert weights "
            f"{human(self.nonexpert)}, KV cache {human(self.kv)}, scratch {human(self.scratch)}, margin "
            f"{human(self.margin)} -> expert cache {human(max(self.expert_cache, 0))} of {human(self.expert_total)}"
        )


MARGIN_FIXED, MARGIN_DIV = 64 * 2**20, 32


def margin_bytes(budget: int) -> int:
    """Slack for what the plan cannot see (Python heap growth, kernel loading): 64 MiB + 1/32 of the budget."""
    return MARGIN_FIXED + budget // MARGIN_DIV


def scratch_bytes(cfg, ubatch: int = 512) -> int:
    """Activations of one prefill chunk: about a dozen live (tokens x widest layer) float32 temporaries,
    the logits, and kernel scratch."""
    ffn = max(cfg.n_ff_exp, cfg.n_ff_shexp) if cfg.is_moe else cfg.n_ff
    # a hybrid's gated attention projects query and gate (2 x heads), its linear attention the conv's channels
    widest = max(cfg.n_embd, (2 if cfg.full_attn_interval else 1) * cfg.n_head * cfg.head_dim, ffn, cfg.ssm_conv_dim)
    return 32 * 2**20 + ubatch * 12 * widest * 4 + cfg.n_vocab * 4 * 2


def split_at(
    budget: int, baseline: int, nonexpert: int, kv: int, scratch: int, expert_total: int, slot_bytes: int
) -> BudgetSplit:
    """The plan for `budget` given everything else it pays for (the trace replay re-plans recorded runs with it)."""
    return BudgetSplit(budget, baseline, nonexpert, kv, scratch, margin_bytes(budget), expert_total, slot_bytes)


def process_baseline(mapped: int = 0) -> int:
    """What the process holds now, charged to the budget: its RSS, less the `mapped` bytes of model pages it has
    paged in (file-backed, RssFile; counted as the model's)."""
    mem = psutil.Process().memory_info()
    return mem.rss - min(mapped, getattr(mem, "shared", 0))


def split_budget(
    budget: int, cfg, gf, expert_total: int, slot_bytes: int, kv_bytes: int, paged_in=lambda: 0
) -> BudgetSplit:
    """paged_in() -> bytes of the model a page-in has mapped into this process so far (PageIn.mapped: non-expert
    weights, and the experts' bytes sharing their 2 MiB folios): they are in its RSS and counted as the model's, so
    the process's own share leaves them out (asked before the RSS is, so what is mapped meanwhile errs on the safe
    side)."""
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    baseline = process_baseline(paged_in())
    plan = split_at(budget, baseline, nonexpert, kv_bytes, scratch_bytes(cfg), expert_total, slot_bytes)
    need_cache = cfg.n_expert_used * slot_bytes
    if plan.expert_cache < need_cache:
        # the smallest budget B with B - margin(B) >= everything else: the margin grows with the budget
        rest = plan.baseline + nonexpert + kv_bytes + plan.scratch + need_cache
        need = -(-(rest + MARGIN_FIXED) * MARGIN_DIV // (MARGIN_DIV - 1))
        raise StreamerError(
            f"--ram-budget {human(budget)} is too small for this model: it needs at least {human(need)} "
            f"(process {human(plan.baseline)} + non-expert weights {human(nonexpert)} + KV cache "
            f"{human(kv_bytes)} + scratch {human(plan.scratch)} + one layer's {cfg.n_expert_used} "
            f"experts {human(need_cache)}, plus a margin of 64 MiB + 1/32 of the budget); "
            f"lower -c/--ctx-size or raise the budget"
        )
    can_have = plan.baseline + available_memory()
    if budget > can_have and not plan.fits_resident:
        logger.warning(
            f"--ram-budget {human(budget)} is more than this process can have ({human(can_have)}: what it "
            f"holds plus the memory available, cgroup limit included); the expert cache would outgrow "
            f"RAM and the run may be OOM-killed"
        )
    return plan
