"""The benchmark behind `stream-run bench`: warm-up, prefill of pp tokens, greedy decode of tg tokens, with
speed, weight bytes touched per token, disk reads, expert traffic and peak RSS. With several sequences
(--parallel N), N prompts are prefilled together and then decoded together (Model.forward_many, Model.step)."""

from __future__ import annotations

import resource
import time

import numpy as np

from streamer import machine
from streamer.traffic import disk_read_bytes


def prompt_tokens(n_vocab: int, pp: int, seed: int = 1234) -> np.ndarray:
    """A fixed pseudo-random prompt (like llama-bench's random tokens)."""
    return np.random.default_rng(seed).integers(0, n_vocab, size=pp, dtype=np.int64)


def weight_bytes_per_token(session, routed_per_token: float, n_seq: int = 1) -> float:
    """Weight bytes one decoded token reads: every non-expert matrix except the embedding table (one row),
    plus the routed experts' bytes (routed_per_token: expert uses over all layers). n_seq > 1: a batched step's
    tokens share its reads; routed_per_token is then the step's distinct experts over all layers, and the step's
    bytes are divided among its n_seq tokens."""
    gf, cfg = session.gf, session.cfg
    dense = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    embd = gf.tensors["token_embd.weight"]
    if not cfg.tied:  # a tied table is read in full as the head
        dense -= embd.nbytes - embd.nbytes // embd.shape[0]
    if not cfg.is_moe:
        return dense / n_seq
    # the mean over layers: a mixed file (say Q4_K_M's Q6_K ffn_down on some layers) has experts of several sizes
    experts = sum(t.nbytes for t in gf.tensors.values() if "_exps." in t.name)
    return (dense + routed_per_token * experts / (cfg.n_layer * cfg.n_expert)) / n_seq


def _warm_up(session, prompt, progress) -> tuple:
    """The weights used in place come into RAM, as llama.cpp's load reads them (large ordered reads); then, in
    RAM, as llama.cpp's benchmarks warm up (bench/llama_run.py, llama-bench), a prefill of min(pp, 16) prompt
    tokens and one decode step: the timed runs start with the kernels' first calls and their buffers behind
    them. Streamed experts keep one token: a longer warm-up would fill the expert cache. Returns (the page-in,
    its seconds, the disk bytes read meanwhile, the whole warm-up's seconds)."""
    model = session.model
    t0 = time.perf_counter()
    disk0 = disk_read_bytes()
    pagein = session.populate(progress)
    pagein_s = time.perf_counter() - t0
    pagein_disk = disk_read_bytes() - disk0
    warm = model.new_state()
    model.forward(prompt[: 1 if session.streaming else max(1, min(len(prompt), 16))], warm)
    model.forward(prompt[:1], warm)
    return pagein, pagein_s, pagein_disk, time.perf_counter() - t0


def run_bench(
    session,
    pp: int = 128,
    tg: int = 64,
    load_s: float = 0.0,
    random_decode: bool = False,
    progress=None,
    parallel: int = 1,
) -> dict:
    """random_decode feeds each decode step a fresh random token instead of the greedy one: routing then
    never repeats (greedy text from random weights falls into loops), the worst case for an expert cache.
    progress(done, total): bytes of the warm-up's page-in. parallel: sequences, each with its own random
    prompt (sequence 0's is the one-sequence run's), prefilled together and decoded together; tg_tok_s is then
    each sequence's rate and aggregate_tg_tok_s all of them together (generated tokens per second of wall time)."""
    model, traffic = session.model, session.traffic
    from streamer.kernels import int8  # numba: the session has loaded it; `stream-run bench --help` does not

    state = {**machine.describe(), "activation_digits": int8.DIGITS}  # the kernels' precision (int8.py)
    n_vocab = session.cfg.n_vocab
    prompts = [prompt_tokens(n_vocab, pp, seed=1234 + s) for s in range(parallel)]
    feed = [prompt_tokens(n_vocab, tg, seed=99 + s) for s in range(parallel)] if random_decode else None
    pagein, pagein_s, pagein_disk, warmup_s = _warm_up(session, prompts[0], progress)
    if traffic is not None:
        traffic.reset()
    states = [model.new_state() for _ in range(parallel)]
    disk0 = disk_read_bytes()
    t0 = time.perf_counter()
    tokens = _prefill(model, prompts, states)
    t_pp = time.perf_counter() - t0
    pp_report = traffic.report() if traffic is not None else None
    if traffic is not None:
        traffic.reset()
    t0 = time.perf_counter()
    steps = _decode(model, states, tokens, tg, feed)
    t_tg = time.perf_counter() - t0
    tg_report = traffic.report() if traffic is not None else None
    tg_tok_s = (tg - 1) / t_tg if tg > 1 and t_tg > 0 else 0.0
    disk = disk_read_bytes() - disk0
    if tg_report is None:
        routed = 0.0
    elif parallel == 1:
        routed = tg_report["totals"]["routed"] / max(tg_report["tokens"], 1)
    else:  # the distinct experts of a step's layer calls, shared by its tokens
        routed = (tg_report["experts_per_call"] or 0.0) * session.cfg.n_layer
    wbytes = weight_bytes_per_token(session, routed, parallel)
    return {
        "pp": pp,
        "tg": tg,
        "parallel": parallel,
        "random_decode": random_decode,
        "load_s": load_s,
        "warmup_s": warmup_s,
        # what the budget keeps resident (the page-in read what was not cached), and the 2 MiB blocks the page
        # cache held in small folios, read again (pagein.py)
        "pagein_bytes": pagein.total - pagein.reread_bytes,
        "pagein_reread_bytes": pagein.reread_bytes,
        "pagein_s": pagein_s,  # waited for it in the warm-up (the background page-in had started at open)
        "pagein_disk_bytes": pagein_disk,  # read from disk meanwhile (process counters)
        "pagein_disk_gb_s": pagein_disk / pagein_s / 1e9 if pagein_s > 0 else 0.0,
        "pp_tok_s": parallel * pp / t_pp if t_pp > 0 else 0.0,
        "tg_tok_s": tg_tok_s,  # per sequence
        "aggregate_tg_tok_s": parallel * tg_tok_s,  # every sequence's generated tokens per second of wall time
        # the decode steps' spread: min, median, 90th percentile and max, ms (a slow run uniformly slow, or stalled)
        "tg_step_ms": step_quantiles(steps),
        "weight_bytes_per_token": wbytes,
        "weight_gb_s": wbytes * parallel * tg_tok_s / 1e9,
        "disk_read_bytes": disk,
        **_expert_figures(pp_report, tg_report, disk),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "machine": state,  # at the start: CPU, ISA, memory, THP, free page reporting, the kernel's counters
        "machine_during": machine.during(state),  # the machine's page-fault and reclaim counters' growth
        "tokens": tokens[0],
        "tokens_per_sequence": tokens,
    }


def _prefill(model, prompts, states) -> list[list[int]]:
    """The prompts prefilled together, at most Model.ubatch tokens a forward: each sequence's first token."""
    share = max(1, model.ubatch // len(prompts))
    for s in range(0, len(prompts[0]), share):
        logits = model.forward_many([p[s : s + share] for p in prompts], states)
    return [[int(np.argmax(row))] for row in logits]


def _decode(model, states, tokens, tg: int, feed) -> np.ndarray:
    """tg - 1 decode steps of every sequence together (their greedy tokens, or feed's), appended to tokens;
    each step's seconds, the tokens' argmax included."""
    steps = np.empty(max(tg - 1, 0))
    for i in range(tg - 1):
        ts = time.perf_counter()
        nxt = [t[-1] for t in tokens] if feed is None else [int(f[i]) for f in feed]
        logits = model.step(nxt, states)  # one sequence: its one-token forward
        for t, row in zip(tokens, logits):
            t.append(int(np.argmax(row)))
        steps[i] = time.perf_counter() - ts
    return steps


def _expert_figures(pp: dict | None, tg: dict | None, disk: int) -> dict:
    """The expert traffic's figures of a run (prefill's report pp, decode's tg; None for a dense model)."""
    requested = pp["read_bytes"] + tg["read_bytes"] if tg is not None else 0
    return {
        "experts_per_step": tg["experts_per_call"] if tg else None,  # distinct, per layer per step
        "shared_bytes_per_token": tg["totals"]["shared_bytes"] / max(tg["tokens"], 1) if tg else 0.0,
        "expert_read_bytes": requested,  # expert bytes our cache asked for (demand + prefetch), pp + tg
        "disk_per_expert_byte": disk / requested if requested else None,
        "expert_hit_rate": tg["hit_rate"] if tg else None,  # cached before use; prefetch not counted
        "prefetched_rate": tg["prefetched_rate"] if tg else None,
        "demand_miss_rate": tg["miss_rate"] if tg else None,
        "read_bytes_per_token": tg["read_bytes_per_token"] if tg else 0.0,
        "prefetch_recall": tg["prefetch_recall"] if tg else None,
        "skipped_weight_share": tg["skipped_weight_share"] if tg else 0.0,  # --expert-skip, decode
        "skipped_bytes_per_token": tg["skipped_bytes_per_token"] if tg else 0.0,
        "io_stall_share": tg["stall_share"] if tg else 0.0,
        "prefill_read_bytes": pp["read_bytes"] if pp else 0,
    }


def step_quantiles(steps: np.ndarray) -> dict | None:
    """{min, median, p90, max} of the step times in ms, or None without a step."""
    if not steps.size:
        return None
    q = np.quantile(steps * 1e3, [0.0, 0.5, 0.9, 1.0])
    return {k: round(float(v), 3) for k, v in zip(("min", "median", "p90", "max"), q)}


def _rates(r: dict) -> str:
    if r["parallel"] == 1:
        return f"{r['tg_tok_s']:.2f} tok/s "
    experts = f", {r['experts_per_step']:.1f} distinct experts per layer per step" if r["experts_per_step"] else ""
    return f"{r['aggregate_tg_tok_s']:.2f} tok/s in all, {r['tg_tok_s']:.2f} per sequence{experts} "


def format_bench(r: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    per_seq = f" x {r['parallel']} sequences" if r["parallel"] > 1 else ""

    return "\n".join(
        [
            f"load     {r['load_s']:.2f} s (open, budget plan, kernels), warm-up {r['warmup_s']:.2f} s (weights into RAM: "
            f"{r['pagein_bytes'] / 2**30:.2f} GiB paged in, {r['pagein_disk_bytes'] / 2**30:.2f} GiB of it read from "
            f"disk in {r['pagein_s']:.2f} s, {r['pagein_disk_gb_s']:.2f} GB/s)",
            f"prefill  {r['pp']} tokens{per_seq}: {r['pp_tok_s']:.2f} tok/s",
            f"decode   {r['tg']} tokens{per_seq}{' (random inputs)' if r['random_decode'] else ''}: "
            + _rates(r)
            + f"({r['weight_bytes_per_token'] / 2**20:.0f} MiB of weights per token = {r['weight_gb_s']:.2f} GB/s)"
            + (
                ", steps {min:.1f} / {median:.1f} / {p90:.1f} / {max:.1f} ms (min / median / p90 / max)".format(
                    **r["tg_step_ms"]
                )
                if r["tg_step_ms"]
                else ""
            ),
            f"disk     {r['disk_read_bytes'] / 2**20:.1f} MiB read (process counters, prefill + decode)"
            + (f", {r['disk_per_expert_byte']:.3f}x the expert bytes requested" if r["disk_per_expert_byte"] else ""),
            f"experts  hit rate {pct(r['expert_hit_rate'])}, prefetched {pct(r['prefetched_rate'])}, demand reads "
            f"{pct(r['demand_miss_rate'])}, {r['read_bytes_per_token'] / 2**20:.1f} MiB read per "
            f"decoded token, prefetch recall {pct(r['prefetch_recall'])}, I/O stall {pct(r['io_stall_share'])}",
            f"memory   peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
            f"machine  {machine.line(r['machine'], r['machine_during'])}",
        ]
    )
