"""Open a model file into everything a command needs: file, config, model, tokenizer, with kernels warmed up."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from streamer import timing
from streamer.budget import (
    process_baseline,
    resolve as resolve_budget,
    roomy,
    scratch_bytes,
    split_at,
    split_budget,
)
from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.experts.store import ExpertLayout
from streamer.filewatch import FileWatch
from streamer.gguf_file import GGUFFile
from streamer.io import human
from streamer.options import StreamOptions
from streamer.pagein import PageIn, readahead_bytes
from streamer.tokenizer import Tokenizer

if TYPE_CHECKING:  # the heavy modules (numba kernels) load when a model is opened, not on import
    from streamer.model import Model
    from streamer.moe import MoEFFN
    from streamer.traffic import ExpertTraffic


logger = logging.getLogger(__name__)


@contextmanager
def notice_if_slow(message: str, after_s: float = 0.5):
    """Log `message` if the block is still running after `after_s` (e.g. numba compiling on a first run),
    then, on the same line, how long it took. Silent when fast (kernels loaded from numba's cache)."""
    shown = threading.Event()

    def show():
        shown.set()
        logger.info(message, extra={"end": ""})

    timer = threading.Timer(after_s, show)
    t0 = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            logger.info(f" done in {time.perf_counter() - t0:.1f} s")


@dataclass
class Session:
    gf: GGUFFile
    cfg: ModelConfig
    model: Model
    moe: MoEFFN | None = None  # the model's FFN when it is a MoE (its expert source, traffic counters, plan)
    _tokenizer: Tokenizer | None = None
    pagein: PageIn | None = None  # the background page-in open_model started (None: nothing fits the budget)
    kernels: list = field(default_factory=list)  # the numba dispatchers a run of this model may call
    # how many of these dispatchers have loaded or compiled: warmup.loaded, set when the kernels load
    loaded: Callable[[list], int] = lambda kernels: 0
    _building: threading.Thread | None = None  # tokenizer_in_background's thread, until .tokenizer joins it

    def report(self, stream) -> None:
        """Print the expert traffic summary (MoE only)."""
        if self.moe is not None:
            print(self.moe.traffic.summary(), file=stream)

    @property
    def streaming(self) -> bool:
        return self.moe is not None and self.moe.source.streams

    def populate(self, progress=None) -> PageIn:
        """Bring the weights the budget keeps resident (pagein_ranges) into memory now, at the disk's
        sequential speed (benchmarks do this, as llama.cpp's load does): wait for the background page-in
        open_model started. progress(done, total) in bytes."""
        if self.pagein is None:  # nothing fits the budget (open_model decided): nothing is read up front
            self.pagein = PageIn(self.gf.mm, [])
            self.pagein.run(progress)
        else:
            self.pagein.wait(progress)
        if self.moe is not None and not self.streaming:
            self.moe.source.resident()  # every expert is in RAM: no read-ahead or lookahead needed
        return self.pagein

    def mark_first_token(self) -> None:
        """timing.mark the first token, with what was read for it: the page-in's bytes (and when it ended, if
        it did), the expert bytes read on demand and by prefetch, the seconds the forward waited for them."""
        if not timing.ENABLED:
            return
        figures = {}
        if self.pagein is not None:
            figures.update(pagein_bytes=self.pagein.done, pagein_total=self.pagein.total)
            if self.pagein.finished and self.pagein.ended is not None:
                timing.mark("pagein_end", self.pagein.ended)
        if self.moe is not None:
            layers = self.moe.traffic.layers
            figures.update(
                expert_demand_bytes=sum(st.read_bytes for st in layers),
                expert_prefetch_bytes=sum(st.prefetch_bytes for st in layers),
                expert_stall_s=round(sum(st.stall_s for st in layers), 4),
            )
        timing.mark("first_token", kernels_loaded=self.loaded(self.kernels), **figures)

    @property
    def traffic(self) -> ExpertTraffic | None:
        """The expert traffic counters (MoE only), else None."""
        return self.moe.traffic if self.moe is not None else None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join the page-in and expert reader threads and release the file watch."""
        if self.pagein is not None:
            self.pagein.stop()
        if self.moe is not None:
            self.moe.close()
        if self.model.watch is not None:
            self.model.watch.close()
        trace = getattr(self.traffic, "trace", None)
        if trace is not None:  # after the readers stopped: every landing is in
            self.traffic.trace = None
            trace.save()
            logger.info(f"wrote routing trace {trace.path} ({trace.step + 1} steps)")
        timing.mark("closed")

    @property
    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer: the one given, or built now (or by tokenizer_in_background's thread: waited for)."""
        building, self._building = self._building, None
        if building is not None:
            building.join()
        if self._tokenizer is None:  # not started, or its build failed: build (and report) it here
            self._tokenizer = Tokenizer.from_gguf(self.gf)
        return self._tokenizer

    def tokenizer_in_background(self) -> None:
        """Start building the tokenizer in a daemon thread (a prompt given as token ids needs it only to print
        what is generated: building a vocabulary of 150k tokens or more then runs while the forward waits for
        the disk, not before it); .tokenizer waits for it. A failed build is retried, and reported, there."""
        if self._tokenizer is not None or self._building is not None:
            return

        def build() -> None:
            try:
                self._tokenizer = Tokenizer.from_gguf(self.gf)
            except Exception:  # .tokenizer builds it again and raises there, in the caller's thread
                pass

        self._building = threading.Thread(target=build, name="stream-run tokenizer", daemon=True)
        self._building.start()


def resident_ranges(gf: GGUFFile, streaming: bool) -> list[tuple[int, int]]:
    """(offset, length) of the tensors used in place: all of them, or all but the experts when streaming."""
    return [(t.offset, t.nbytes) for t in gf.tensors.values() if "_exps." not in t.name or not streaming]


def forward_order(gf: GGUFFile, ranges) -> list[tuple[int, int]]:
    """The ranges in the order a first forward pass wants them: the non-expert weights (attention, norms,
    routers, output head) in file order, then the experts in file order (layer by layer), the token embedding
    table last (a prompt needs a few of its rows, which it faults in itself)."""

    def kind(t) -> int:
        return 2 if t.name == "token_embd.weight" else 1 if "_exps." in t.name else 0

    kinds = {t.offset: kind(t) for t in gf.tensors.values()}
    return sorted(ranges, key=lambda r: (kinds.get(r[0], 1), r[0]))


def pagein_ranges(gf: GGUFFile, moe: MoEFFN | None, budget: int) -> list[tuple[int, int]]:
    """What to read into RAM up front, in forward order, and never more than the RAM budget keeps resident:
    - streaming: the non-expert weights (the plan counts them in the budget; experts go to the expert cache)
      but the embedding table, unless it is also the output head: each token faults in its own row;
    - a MoE whose plan found every expert fits: the whole file;
    - otherwise (dense, --no-stream): everything used in place if it fits in `budget`
      (the run's budget in bytes), else nothing (the OS pages it as it is used)."""
    streaming = moe is not None and moe.source.streams
    ranges = resident_ranges(gf, streaming)
    if streaming and "output.weight" in gf.tensors:  # untied: a prompt needs a few rows of the embedding table
        embd = gf.tensors["token_embd.weight"]
        ranges = [r for r in ranges if r[0] != embd.offset]
    if not streaming and not (moe is not None and moe.plan is not None and moe.plan.fits_resident):
        if sum(n for _, n in ranges) > budget:
            return []
    return forward_order(gf, ranges)


def advise_pages(gf: GGUFFile) -> None:
    """Expert bytes in the mapping get MADV_RANDOM: a fault on one never reads neighbouring experts ahead.
    Streamed experts are read into our own cache; resident ones are read in large requests by the page-in
    (streamer/pagein.py) or, ahead of it, expert by expert as they are first needed (experts/source.py).
    So does an embedding table that is not the output head: a token's row faults in alone, not the
    read_ahead_kb around it. The page-in reads the rest in large requests; their faults keep readahead."""
    rows = "token_embd.weight" if "output.weight" in gf.tensors else None
    gf.advise(
        [(t.offset, t.nbytes) for t in gf.tensors.values() if "_exps." in t.name or t.name == rows], mmap.MADV_RANDOM
    )


def start_pagein(session: Session, budget: int, early: PageIn | None = None) -> None:
    """Read what the budget keeps resident in the background, in the order the forward pass needs it, so the
    first token waits for its own bytes only and the rest arrives at the disk's sequential speed. early: the
    page-in open_model started before the kernels loaded (early_plan); it goes on with the rest."""
    ranges = pagein_ranges(session.gf, session.moe, budget)
    whole = sum(n for _, n in ranges) == sum(t.nbytes for t in session.gf.tensors.values())
    if early is not None:
        if early.huge and not whole:
            early.partial()
        have = {(p.offset, p.nbytes) for p in early_tensors(session.gf)}
        early.extend([r for r in ranges if r not in have])
        session.pagein = early
    elif ranges and session.gf.mm is not None:
        session.pagein = _pagein(session.gf, ranges, whole)


def early_tensors(gf: GGUFFile) -> list:
    """The tensors every forward pass reads whole: all but the experts and an embedding table that is not
    also the output head (a prompt needs a few of its rows)."""
    untied = "output.weight" in gf.tensors
    return [t for t in gf.tensors.values() if "_exps." not in t.name and not (untied and t.name == "token_embd.weight")]


def early_plan(
    gf: GGUFFile,
    cfg: ModelConfig,
    options: StreamOptions,
    budget: int,
    n_ctx: int | None,
    rss_margin: int = 0,
    mapped: int = 0,
) -> tuple[list[tuple[int, int]], bool]:
    """(ranges, whole): what open_model may start reading before any kernel loads, early_tensors in forward order,
    when the budget is sure to keep them: a streamed MoE whose plan holds the non-expert weights and one layer's
    experts (checked with the process as it is now plus rss_margin), or a model whose weights all fit. Nothing
    otherwise. whole: every byte of the file stays resident, so the page-in may use 2 MiB pages (PageIn's huge mode).
    mapped: bytes of those weights already mapped by an early page-in (not counted by split_budget as the process's
    own). budget: the run's RAM budget in bytes (budget.resolve)."""
    tensors = early_tensors(gf)
    if cfg.is_moe and options.stream:
        if options.expert_cache_bytes is None:
            layout = ExpertLayout(gf, cfg)
            kv = cfg.state_bytes(cfg.context(n_ctx), options.n_seq)
            nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
            mem = psutil.Process().memory_info()
            rss = mem.rss - min(mapped, getattr(mem, "shared", 0)) + rss_margin
            plan = split_at(budget, rss, nonexpert, kv, scratch_bytes(cfg), layout.total_bytes, layout.slot_bytes)
            if plan.expert_cache < cfg.n_expert_used * layout.slot_bytes:
                return [], False
            whole = plan.fits_resident
        else:
            whole = False
    elif sum(t.nbytes for t in gf.tensors.values()) > budget:
        return [], False
    else:
        whole = True
    return forward_order(gf, [(t.offset, t.nbytes) for t in tensors]), whole


def run_budget(gf: GGUFFile, cfg: ModelConfig, options: StreamOptions, n_ctx: int | None) -> int:
    """The run's RAM budget in bytes: --ram-budget as given, else budget.resolve's share of the available
    memory, widened (budget.roomy) for a streamed MoE that fits whole in a larger share: it runs in place."""
    budget = resolve_budget(options.ram_budget)
    if options.ram_budget is None and cfg.is_moe and options.stream and options.expert_cache_bytes is None:
        budget = roomy(budget, lambda b: moe_fits_resident(gf, cfg, n_ctx, b, options.n_seq))
    return budget


def moe_fits_resident(gf: GGUFFile, cfg: ModelConfig, n_ctx: int | None, budget: int, n_seq: int = 1) -> bool:
    """Whether the budget plan keeps every expert of the file in place at this budget (n_seq sequences' states)."""
    layout = ExpertLayout(gf, cfg)
    kv = cfg.state_bytes(cfg.context(n_ctx), n_seq)
    try:
        return split_budget(budget, cfg, gf, layout.total_bytes, layout.slot_bytes, kv).fits_resident
    except StreamerError:  # too small to run at all
        return False


def start_early_pagein(
    gf: GGUFFile, cfg: ModelConfig, options: StreamOptions, budget: int, n_ctx: int | None, started=None
) -> PageIn | None:
    """Start reading early_plan's ranges in the background (None: nothing to read). started: (ranges, PageIn) a
    caller began before it had the options (the CLI's entry point, cli/early.py): it goes on if it reads
    exactly these ranges, else it is stopped."""
    held = started[1] if started is not None else None
    ranges, whole = early_plan(gf, cfg, options, budget, n_ctx, mapped=held.mapped() if held is not None else 0)
    if held is not None:
        if started[0] == ranges:
            if held.huge and not whole:
                held.partial()
            return held
        held.stop()
    if not ranges or gf.mm is None:
        return None
    return start_pagein_of(gf, ranges, whole)


def start_pagein_of(gf: GGUFFile, ranges, whole: bool = False) -> PageIn:
    """A background page-in of `ranges` (in that order), started; whole: the file will be read whole (huge)."""
    p = _pagein(gf, ranges, whole)
    timing.mark("pagein_start", early_pagein_bytes=p.total)
    return p


def _pagein(gf: GGUFFile, ranges, whole: bool) -> PageIn:
    """A background page-in of the file's `ranges`, started (huge mode when whole; blocks held in small folios read
    again through gf.drop_cached)."""
    return PageIn(gf.mm, ranges, step=readahead_step(gf), huge=whole, evict=gf.drop_cached).start()


def readahead_step(gf: GGUFFile) -> int:
    """Bytes one MADV_WILLNEED may cover on every file of the model (shards may sit on different disks)."""
    return min(readahead_bytes(s.path) for s in gf.shards)


def warn_dense_budget(gf: GGUFFile, cfg: ModelConfig, n_ctx: int | None, budget: int, n_seq: int = 1) -> None:
    """A dense model has nothing to stream: say so if its weights and KV cache exceed the budget."""
    need = sum(t.nbytes for t in gf.tensors.values()) + cfg.state_bytes(cfg.context(n_ctx), n_seq)
    if need > budget:
        logger.warning(
            f"this dense model needs {human(need)} (weights + KV cache), more than --ram-budget "
            f"{human(budget)}; it has no experts to stream, so the OS will page its weights"
        )


def read_model_into_memory(
    gf: GGUFFile, cfg: ModelConfig, options: StreamOptions, budget: int, n_ctx: int | None, progress=None
) -> None:
    """--no-mmap: check that the whole file, the KV cache, the scratch and the process as it stands fit the RAM
    budget (this memory cannot be paged out), then read the file into memory (GGUFFile.read_into_memory).
    progress(done, total) in bytes; without it a line is logged if the read is slow."""
    rest = cfg.state_bytes(cfg.context(n_ctx), options.n_seq) + scratch_bytes(cfg) + process_baseline()
    if gf.size + rest > budget:
        which = f"--ram-budget {human(budget)}" if options.ram_budget is not None else f"the RAM budget {human(budget)}"
        raise StreamerError(
            f"--no-mmap reads the whole model into memory: {human(gf.size)} plus {human(rest)} for the process, "
            f"KV cache and scratch, more than {which}; drop --no-mmap to use the file in place"
            + (" and stream its experts" if cfg.is_moe else "")
        )
    logger.info(
        f"RAM budget {human(budget)}: the model's {human(gf.size)} read into memory, {human(rest)} for the process, "
        f"KV cache and scratch"
    )
    if progress is not None:
        gf.read_into_memory(options.io.direct, progress)
    else:
        with notice_if_slow(f"reading {human(gf.size)} into memory..."):
            gf.read_into_memory(options.io.direct)
    timing.mark("in_memory")


def open_model(
    path: str | os.PathLike | GGUFFile,
    options: StreamOptions = StreamOptions(),
    n_ctx: int | None = None,
    threads: int | None = None,
    tokenizer: Tokenizer | None = None,
    trace=None,
    lazy_kernels: bool = False,
    started_pagein=None,
    load_progress=None,
) -> Session:
    """The file (a path, or a GGUFFile already opened), its model with the FFN the options ask for, kernels compiled
    or loaded from numba's cache. trace: a path to record the MoE's routing trace to (streamer/trace.py).
    lazy_kernels: when numba's cache holds every kernel, leave each to load at its first call (a short prompt never
    loads the kernels it does not use); else run them all once now (no compile time inside what benchmarks time).
    started_pagein: (ranges, PageIn) of a page-in the CLI started before it had the options: continued if the budget
    check asks for the same ranges, else stopped. load_progress: progress(done, total) of --no-mmap's read."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    timing.mark("header")
    if trace is not None and not cfg.is_moe:
        raise StreamerError(f"{gf.path} is a dense model: it has no experts, so there is no routing to trace")
    budget = run_budget(gf, cfg, options, n_ctx)  # once: every check below uses this figure
    if options.mmap:
        early = start_early_pagein(gf, cfg, options, budget, n_ctx, started_pagein)  # before the kernels load
    else:
        if started_pagein is not None:
            started_pagein[1].stop()
        read_model_into_memory(gf, cfg, options, budget, n_ctx, load_progress)
        early = None
    try:
        return _open(gf, cfg, options, budget, n_ctx, threads, tokenizer, trace, early, lazy_kernels)
    except BaseException:
        if early is not None:  # the budget plan refused, Ctrl-C, ...: no reads left running
            early.stop()
        raise


def _open(gf, cfg, options, budget, n_ctx, threads, tokenizer, trace, early, lazy_kernels) -> Session:
    # numba and the kernels load here, when a model is opened, not when this module is imported: the page-in
    # open_model (or cli/early.py) started reads while they load, and the CLI's --help and input checks need none
    from streamer import kernels, model as models, moe_build, warmup

    kernels.set_threads(threads)
    timing.mark("kernels_imported")
    moe = None
    if cfg.is_moe:
        paged_in = early.mapped if early is not None else (lambda: 0)
        moe = moe_build.build_moe_ffn(gf, cfg, options, budget, n_ctx=n_ctx, trace=trace, paged_in=paged_in)
    elif options.ram_budget is not None:  # a budget the user gave
        warn_dense_budget(gf, cfg, n_ctx, budget, options.n_seq)
    watch = None if gf.in_memory else FileWatch([s.path for s in gf.shards])  # a copy: the file may change
    model = models.Model(gf, cfg, ffn=moe, n_ctx=n_ctx, watch=watch)
    session = Session(gf, cfg, model, moe, tokenizer)
    if not gf.in_memory:
        advise_pages(gf)
        start_pagein(session, budget, early)
    timing.mark("model_built")
    session.kernels = warmup.model_kernels(model, cfg.is_moe, cfg.is_moe and moe.needs_tiles())
    session.loaded = warmup.loaded  # not a closure over the session: a cycle would outlive close()
    all_cached = warmup.cached(session.kernels)
    if not (lazy_kernels and all_cached):  # compile now, not inside the first token
        with notice_if_slow("compiling kernels (first run only; numba caches them)..."):
            qtypes, only = None, ()
            if cfg.is_moe:  # the multi-expert kernels, or their compile time would land in the first token
                qtypes = {p.qtype for parts in moe.source.layout.parts for p in parts}  # this model's expert formats
                tiles = ("expert-tiles",) if moe.needs_tiles() else ()
                only = ("experts", "decode", "decode-moe", "expert-int8", "expert-lanes") + tiles
            elif model.decodes_in_blocks:  # the one-call decode blocks (a MoE's FFN is never ffn_block)
                only = ("decode", "decode-ffn") if model.ffn_decodes_in_blocks else ("decode",)
            only += ("ops", "recurrent") if cfg.full_attn_interval else ("ops",)
            combos = warmup.decode_formats(model, moe)
            # a second compiling process: only when there is something to compile, and it needs memory of its
            # own, so not under a budget the user set
            helper = not all_cached and options.ram_budget is None
            mq = {m.qtype for m in model.matrices()}  # model.warmup's formats: their groups are shared work too
            warmup.warmup_shared(model.warmup, only, qtypes, combos, helper_allowed=helper, matrix_qtypes=mq)
    timing.mark("warmed_up")
    return session
