#!/usr/bin/env python
"""llama.cpp's batched decoding: N independent sequences decoded together, one llama_decode per step.

A bench/ script, never run in CI. Runs under a Python with llama-cpp-python installed (LLAMA_PYTHON below), never the
project's, through llama-cpp-python's low-level C API (module `llama_cpp`, 0.3.36):

    LLAMA_PYTHON bench/llama_parallel.py MODEL.gguf --parallel 1 2 4 --pp 32 --tg 32 --threads 2 \\
        [--ctx 1024] [--rounds R] [--json OUT]

The model is loaded once (mmap, no mlock). For each N of --parallel a context with n_seq_max=N is made (and freed
after the run): n_ctx = N x --ctx, so with llama.cpp's default per-sequence KV streams every sequence has --ctx
cells (--kv-unified: one buffer shared by all N, same total). Sequence s (ids 0..N-1) gets its own prompt of --pp
pseudo-random ids (numpy default_rng(1234 + s) over the whole vocabulary; sequence 0's is the prompt of
`stream-run bench` and bench/llama_run.py). All N prompts are prefilled in ONE llama_decode (timed separately,
including the greedy pick of each sequence's first token), then tg - 1 decode steps are timed: each step is ONE
llama_batch holding one token per sequence (the greedy argmax of that sequence's last logits, at its own position,
with its own seq id, logits requested for every token). Per N it reports:

  * aggregate decode tok/s = N x (tg - 1) / decode seconds (what a server with N busy slots would deliver),
  * per-sequence decode tok/s = (tg - 1) / decode seconds (what each client sees),
  * prefill tok/s = N x pp / prefill seconds,
  * the decode steps' min / median / p90 / max ms (bench/llama_run.py's tg_step_ms).

Correctness check: before the sweep, every sequence's prompt is also run alone in an n_seq_max=1 context (one
after the other, the memory cleared between them; untimed, and it doubles as the warm-up that pages the weights
in). Each N's line says whether all its sequences' tg greedy tokens equal those solo runs' ("tokens identical to
N=1"); the JSON keeps each sequence's first 8 tokens. --no-check runs sequence 0 alone only (the warm-up) and
checks sequence 0 only.

--rounds R > 1 repeats the sweep R times, the order of N reversed every other round, and reports medians over the
rounds (the step ms are pooled over all rounds). --json OUT writes everything (per round too) to OUT, atomically.

llama-cpp-python 0.3.36 notes (read from llama_cpp/llama_cpp.py and llama.py):
  * The KV cache is reached through the memory API: llama_memory_clear(llama_get_memory(ctx), True); there is no
    llama_kv_self_* or llama_kv_cache_* function in this version.
  * llama_context_params has n_outputs_max_per_seq, default 1, but llama_decode still returns every requested
    output row: three rows of one sequence in one batch came back equal to three one-token decodes. This script
    asks for one row per sequence per llama_decode anyway (each prompt's last token, every decode-step token).
  * llama.cpp rounds each sequence's KV cells up to a multiple of 256 (--ctx 16 with N=3 gave n_ctx 768,
    n_ctx_seq 256); the JSON records the n_ctx and n_ctx_seq it really used.
  * llama_context_default_params() has flash_attn_type AUTO (-1), but Llama() sets DISABLED unless flash_attn=True,
    so bench/llama_run.py runs without flash attention; --flash-attn defaults to off to match it.
  * llama_model_default_params() has load_mode AUTO (-1); Llama(use_mmap=True) sets LLAMA_LOAD_MODE_MMAP, and so
    does this script.
  * llama.cpp computes a ubatch of one token with n_threads and a bigger one with n_threads_batch, so an N=1 step
    and an N>1 step would use different thread counts unless both are --threads (they are).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()

import llama_cpp as C  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# bench/llama_run.py imports only llama_cpp, numpy and psutil (all in the llama.cpp venv): reuse its log capture,
# prompt, step quantiles and version strings so the two scripts' figures line up.
from llama_run import LogCapture, default_prompt, step_quantiles, versions  # noqa: E402

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
N_FIRST = 8  # first generated tokens kept in the JSON per sequence


def load_model(path: str, args):
    """llama_model_load_from_file with mmap (no mlock) and repacking unless --no-repack; the model pointer."""
    p = C.llama_model_default_params()
    p.load_mode = C.LLAMA_LOAD_MODE_MMAP
    p.use_extra_bufts = not args.no_repack
    model = C.llama_model_load_from_file(path.encode(), p)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed: {path}")
    return model


def new_context(model, n_seq: int, args):
    """A context for n_seq parallel sequences: --ctx KV cells each, one llama_decode able to take the whole
    prefill of n_seq x pp tokens (n_batch), split into ubatches of --n-ubatch."""
    p = C.llama_context_default_params()
    p.n_seq_max = n_seq
    p.n_ctx = args.ctx * n_seq
    p.kv_unified = args.kv_unified
    p.n_batch = max(n_seq * args.pp, n_seq)
    p.n_ubatch = min(args.n_ubatch, p.n_batch)
    p.n_threads = args.threads
    p.n_threads_batch = args.threads
    p.flash_attn_type = FLASH_ATTN[args.flash_attn]
    ctx = C.llama_init_from_model(model, p)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed for n_seq_max={n_seq}")
    # Without kv_unified llama.cpp gives each sequence n_ctx / n_seq_max cells; with it the n_ctx cells are shared.
    per_seq = C.llama_n_ctx_seq(ctx) if not args.kv_unified else C.llama_n_ctx(ctx) // n_seq
    if per_seq < args.pp + args.tg:
        C.llama_free(ctx)
        raise RuntimeError(f"n_seq_max={n_seq}: {per_seq} KV cells per sequence < pp + tg = {args.pp + args.tg}")
    return ctx


def context_info(ctx) -> dict:
    return {
        "n_ctx": C.llama_n_ctx(ctx),
        "n_ctx_seq": C.llama_n_ctx_seq(ctx),
        "n_batch": C.llama_n_batch(ctx),
        "n_ubatch": C.llama_n_ubatch(ctx),
        "n_seq_max": C.llama_n_seq_max(ctx),
    }


def fill(batch, rows: list[tuple[int, int, int, bool]]) -> None:
    """Write (token, position, seq id, wants logits) rows into a llama_batch from llama_batch_init (one seq id per
    token). The struct's arrays are raw C pointers: index them, the batch only knows its size through n_tokens."""
    for i, (tok, pos, seq, out) in enumerate(rows):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = out
    batch.n_tokens = len(rows)


def decode(ctx, batch) -> None:
    rc = C.llama_decode(ctx, batch)
    if rc != 0:  # 1: no KV slot, 2: aborted, < 0: invalid batch or fatal error
        raise RuntimeError(f"llama_decode returned {rc}")


def argmax_at(ctx, i: int, n_vocab: int) -> int:
    """Greedy token from the logits of batch row i (llama_get_logits_ith maps the row to its output slot)."""
    ptr = C.llama_get_logits_ith(ctx, i)
    if not ptr:
        raise RuntimeError(f"no logits for batch row {i}")
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))


def generate(ctx, batch, prompts: list[list[int]], args, n_vocab: int) -> dict:
    """Prefill every prompt (sequence s = prompts[s]) in one llama_decode, then tg - 1 steps of one token per
    sequence in one llama_decode each; greedy. The context's memory must be empty. Returns the tg tokens of every
    sequence, the prefill seconds and each step's seconds."""
    n, pp = len(prompts), args.pp
    rows = [(tok, pos, s, pos == pp - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
    fill(batch, rows)  # before the timer: building the batch in Python is not llama.cpp's prefill
    t0 = time.perf_counter()
    decode(ctx, batch)
    toks = [[argmax_at(ctx, s * pp + pp - 1, n_vocab)] for s in range(n)]
    prefill_s = time.perf_counter() - t0
    steps = []
    for j in range(args.tg - 1):
        ts = time.perf_counter()
        fill(batch, [(toks[s][-1], pp + j, s, True) for s in range(n)])
        decode(ctx, batch)
        for s in range(n):
            toks[s].append(argmax_at(ctx, s, n_vocab))
        steps.append(time.perf_counter() - ts)
    return {"tokens": toks, "prefill_s": prefill_s, "steps": steps}


def with_context(model, n_seq: int, args, fn):
    """Run fn(ctx, batch) in a fresh n_seq context and batch, both freed afterwards; (fn's result, context info)."""
    ctx = new_context(model, n_seq, args)
    batch = C.llama_batch_init(max(n_seq * args.pp, n_seq), 0, 1)  # token ids (embd=0), one seq id per token
    try:
        return fn(ctx, batch), context_info(ctx)
    finally:
        C.llama_batch_free(batch)
        C.llama_free(ctx)


def reference(model, prompts: list[list[int]], args, n_vocab: int) -> list[list[int]]:
    """Each prompt's tg greedy tokens decoded alone (n_seq_max=1, seq id 0), the memory cleared between prompts."""

    def run(ctx, batch):
        out = []
        for p in prompts:
            C.llama_memory_clear(C.llama_get_memory(ctx), True)
            out.append(generate(ctx, batch, [p], args, n_vocab)["tokens"][0])
        return out

    return with_context(model, 1, args, run)[0]


def mismatches(toks: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """The sequences (with a reference) whose tokens differ from it, and the first index where they do."""
    out = []
    for s, (a, b) in enumerate(zip(toks, ref)):
        if a != b:
            out.append({"seq": s, "first_diff": next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)})
    return out


def run_one(model, n_seq: int, prompts, args, n_vocab: int, ref) -> dict:
    g, info = with_context(model, n_seq, args, lambda ctx, batch: generate(ctx, batch, prompts[:n_seq], args, n_vocab))
    dec_s = sum(g["steps"])
    n_dec = args.tg - 1
    return {
        **info,
        "prefill_s": g["prefill_s"],
        "prefill_tok_s": n_seq * args.pp / g["prefill_s"],
        "decode_s": dec_s,
        "agg_tok_s": n_seq * n_dec / dec_s,
        "seq_tok_s": n_dec / dec_s,
        "step_ms": step_quantiles(g["steps"]),
        "steps_s": g["steps"],
        "first_tokens": [t[:N_FIRST] for t in g["tokens"]],
        "mismatches": mismatches(g["tokens"], ref),
    }


def fmt(n_seq: int, r: dict, checked: int) -> str:
    line = f"N={n_seq:3d}  prefill {r['prefill_tok_s']:8.2f} tok/s  decode {r['agg_tok_s']:8.2f} tok/s aggregate"
    line += f" {r['seq_tok_s']:7.2f} per sequence"
    line += "  steps {median:.1f} / {min:.1f} / {max:.1f} ms (median / min / max)".format(**r["step_ms"])
    bad = r["mismatches"]
    ok = "yes" if not bad else "no (" + ", ".join(f"seq {m['seq']} from token {m['first_diff']}" for m in bad) + ")"
    scope = (
        "" if checked >= n_seq else (" [sequence 0 only]" if checked == 1 else f" [sequences 0..{checked - 1} only]")
    )
    return line + f"\n       tokens identical to N=1: {ok}{scope}"


def write_json(path: str, res: dict) -> None:
    """Write res to path through a temporary file in the same directory and os.replace: never a half-written file."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".llama_parallel.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4], help="sequence counts N to sweep")
    ap.add_argument("--pp", type=int, default=32, help="prompt tokens per sequence (prefilled, timed separately)")
    ap.add_argument("--tg", type=int, default=32, help="greedy tokens per sequence (tg - 1 timed decode steps)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="n_threads = n_threads_batch")
    ap.add_argument("--ctx", type=int, default=0, help="KV cells per sequence (default: pp + tg rounded up to 256)")
    ap.add_argument("--kv-unified", action="store_true", help="one KV buffer shared by the N sequences")
    ap.add_argument("--n-ubatch", type=int, default=512, help="physical batch (n_batch fits the whole prefill)")
    ap.add_argument("--flash-attn", choices=list(FLASH_ATTN), default="off", help="default off, as Llama()")
    ap.add_argument("--no-repack", action="store_true", help="llama_model_params.use_extra_bufts=False")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps, order of N reversed every other one; medians")
    ap.add_argument("--no-check", action="store_true", help="run only sequence 0 alone (warm-up) and check it only")
    ap.add_argument("--json", metavar="OUT", help="write all figures to OUT (atomically)")
    ap.add_argument("--verbose", action="store_true", help="echo llama.cpp's log to stderr")
    args = ap.parse_args(argv)
    if args.tg < 2 or args.pp < 1 or args.rounds < 1 or min(args.parallel) < 1:
        ap.error("need --tg >= 2, --pp >= 1, --rounds >= 1 and every --parallel N >= 1")
    if not os.path.isfile(args.model):
        ap.error(f"no such model file: {args.model}")
    args.ctx = args.ctx or -(-(args.pp + args.tg) // 256) * 256
    if args.ctx < args.pp + args.tg:
        ap.error(f"--ctx {args.ctx} < pp + tg = {args.pp + args.tg}")

    if max(args.parallel) > C.llama_max_parallel_sequences():
        ap.error(f"llama.cpp takes at most {C.llama_max_parallel_sequences()} parallel sequences")
    log = LogCapture(args.verbose)
    C.llama_backend_init()
    t0 = time.perf_counter()
    model = load_model(args.model, args)
    load_s = time.perf_counter() - t0
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    n_max = max(args.parallel)
    prompts = [default_prompt(args.pp, n_vocab, 1234 + s) for s in range(n_max)]

    # Solo runs of the prompts: the check's reference, and the warm-up (weights paged in, threads started).
    t0 = time.perf_counter()
    ref = reference(model, prompts[: 1 if args.no_check else n_max], args, n_vocab)
    ref_s = time.perf_counter() - t0

    runs: dict[int, list[dict]] = {n: [] for n in args.parallel}
    for r in range(args.rounds):
        for n in args.parallel if r % 2 == 0 else args.parallel[::-1]:
            res = run_one(model, n, prompts, args, n_vocab, ref)
            runs[n].append(res)
            if args.rounds > 1:
                print(f"round {r}: " + fmt(n, res, len(ref)), flush=True)
    C.llama_model_free(model)

    print(
        f"\n{Path(args.model).name}: pp {args.pp}, tg {args.tg}, {args.threads} threads, {args.ctx} KV cells per "
        f"sequence{' (unified)' if args.kv_unified else ''}, flash-attn {args.flash_attn}, "
        f"{'no repack' if args.no_repack else 'repack'}, load {load_s:.2f} s, solo runs {ref_s:.2f} s"
        + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else "")
    )
    results = []
    for n in args.parallel:
        rs = runs[n]
        med = {k: statistics.median(x[k] for x in rs) for k in ("prefill_tok_s", "agg_tok_s", "seq_tok_s")}
        summary = {
            "n_parallel": n,
            **{k: rs[0][k] for k in ("n_ctx", "n_ctx_seq", "n_batch", "n_ubatch", "n_seq_max")},
            **med,
            "decode_s": statistics.median(x["decode_s"] for x in rs),
            "step_ms": step_quantiles([s for x in rs for s in x["steps_s"]]),  # pooled over the rounds
            "tokens_identical": all(not x["mismatches"] for x in rs),
            "mismatches": [m for x in rs for m in x["mismatches"]],
            "first_tokens": rs[0]["first_tokens"],
            "rounds": [{k: v for k, v in x.items() if k != "steps_s"} for x in rs],
        }
        results.append(summary)
        print(fmt(n, summary, len(ref)), flush=True)

    if args.json:
        write_json(
            args.json,
            {
                "tool": "llama.cpp",
                "bench": "parallel",
                "model": os.path.abspath(args.model),
                "model_bytes": os.path.getsize(args.model),
                "versions": versions(),
                "n_threads": args.threads,
                "pp": args.pp,
                "tg": args.tg,
                "ctx_per_seq": args.ctx,
                "kv_unified": args.kv_unified,
                "flash_attn": args.flash_attn,
                "repack": not args.no_repack,
                "use_mmap": True,
                "rounds": args.rounds,
                "n_vocab": n_vocab,
                "load_s": load_s,
                "solo_runs_s": ref_s,
                "checked_seqs": len(ref),
                "reference_first_tokens": [t[:N_FIRST] for t in ref],
                "results": results,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "wall_s": time.perf_counter() - T_START,
                "load_log": log.lines,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
