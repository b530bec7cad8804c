#!/usr/bin/env python3
"""Where a MoE forward step spends its time, per layer: attention (kernels and the Python around them), the
router lookahead, the router, the expert kernels, waiting for expert reads, the MoE layer's own Python, and
an estimate of the parallel kernels' thread wake-ups. For decode (one-token steps) and for the prefill.

    python bench/moe_profile.py /work/models/qwen3-30b-a3b-Q4_K.gguf -t 2            # whole model, in RAM
    python bench/moe_profile.py MODEL.gguf --layers 8 -p 32 -n 16                     # first 8 layers only
    python bench/moe_profile.py MODEL.gguf --ram-budget 8G                           # streamed experts

How: the step is run plain first (tok/s with nothing attached), then again with timers wrapped around every
kernel the forward calls (QMatrix.matvec/matmul, the small ops, the MoE kernels in streamer.moe's namespace, int8's)
and around the sections (the model's head, the hooks, the MoE layer, its router, the expert source's wait).
A kernel's time goes to the section it was called from; a section's Python is its time minus its kernels and
the sections inside it. The timers add a few microseconds per call: the instrumented step is printed beside
the plain one. Thread wake-ups are not observable from Python: they are estimated as the number of parallel
kernel launches times the cost of launching an empty parallel kernel, measured in the same process
(included in the kernel times, not added to them).

--layers N runs only the first N transformer layers (the per-layer figures do not depend on how many
follow; the page cache then only has to hold those layers). Runs under the project's venv.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict

import numpy as np

SECTIONS = ("attn", "lookahead", "moe", "router", "wait", "head")


class Timers:
    """Accumulates kernel time per (section, kernel), section time (inclusive and exclusive), and launches."""

    def __init__(self):
        self.stack = ["attn"]
        self.kernel = defaultdict(float)  # (section, name) -> s
        self.calls = defaultdict(int)  # (section, name) -> calls
        self.launches = defaultdict(int)  # section -> parallel kernel launches
        self.incl = defaultdict(float)  # section -> s, inclusive of nested sections
        self.child = defaultdict(float)  # section -> s spent in sections nested in it
        self.on = False
        self.depth = 0  # timed kernels running (nested calls are not timed again)

    def reset(self):
        self.__init__()
        self.on = True


T = Timers()


def timed_kernel(fn, name: str, parallel: bool):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        if not T.on or T.depth:  # a kernel called by a timed one (QMatrix.matmul -> int8.matmul) is its time
            return fn(*a, **k)
        T.depth += 1
        t0 = time.perf_counter()
        try:
            r = fn(*a, **k)
        finally:
            T.depth -= 1
        dt = time.perf_counter() - t0
        sec = T.stack[-1]
        T.kernel[(sec, name)] += dt
        T.calls[(sec, name)] += 1
        T.launches[sec] += parallel
        return r

    wrapper.__wrapped_kernel__ = fn
    return wrapper


def timed_section(fn, sec: str):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        if not T.on or T.stack[-1] == sec:  # off, or nested in itself (MoEFFN.decode's fallback to __call__)
            return fn(*a, **k)
        T.stack.append(sec)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            T.stack.pop()
            T.incl[sec] += dt
            T.child[T.stack[-1]] += dt

    return wrapper


def is_parallel(fn) -> bool:
    return bool(getattr(fn, "targetoptions", {}).get("parallel"))


def instrument(session) -> None:
    """Wrap the kernels and sections of this process's forward pass (module and class attributes)."""
    import numba

    import streamer.moe as moe_mod
    import streamer.moe_compute as compute_mod
    from streamer.kernels import dispatch, ops
    from streamer.model import Model

    Q = dispatch.QMatrix
    Q.matvec = timed_kernel(Q.matvec, "matvec", True)
    Q.matmul = timed_kernel(Q.matmul, "matmul", True)
    Q.rows = timed_kernel(Q.rows, "rows", False)
    from streamer.kernels import int8

    for name in ("matmul", "grouped_matmul", "quantize", "gather"):  # called as int8.X: module attributes
        setattr(int8, name, timed_kernel(getattr(int8, name), f"int8.{name}", True))
    from streamer.kernels import lanes

    lanes.grouped = timed_kernel(lanes.grouped, "lanes.grouped", True)  # the few-token Q4_K experts (with packing)
    for name in ("rmsnorm", "head_norm_rope", "head_rope", "attention", "swiglu", "swiglu_rows"):
        fn = getattr(ops, name)
        setattr(ops, name, timed_kernel(fn, name, is_parallel(fn)))
    for mod in (moe_mod, compute_mod):  # every numba kernel the MoE layer calls by module-level name
        for name, fn in list(vars(mod).items()):
            if isinstance(fn, numba.core.registry.CPUDispatcher):
                setattr(mod, name, timed_kernel(fn, name, is_parallel(fn)))
    from streamer.kernels import decode

    for name in ("attn_block", "ffn_block", "moe_block"):  # one-token blocks: 3 parallel regions each, counted as one
        fn = getattr(decode, name)
        setattr(decode, name, timed_kernel(fn, name, True))
    Model._head = timed_section(Model._head, "head")
    moe = session.moe
    cls = type(moe)
    cls.__call__ = timed_section(cls.__call__, "moe")
    cls.decode = timed_section(cls.decode, "moe")  # one token (its fallback calls __call__: nested, same section)
    cls.after_attention = timed_section(cls.after_attention, "lookahead")
    rcls = type(moe.router)
    rcls.__call__ = timed_section(rcls.__call__, "router")
    moe.source.wait = timed_section(moe.source.wait, "wait")


def launch_cost_us(rounds: int = 2000) -> float:
    """Extra cost of launching an empty parallel kernel over the same kernel compiled serial (us)."""
    from numba import njit, prange

    @njit(parallel=True)
    def par(out):
        for i in prange(out.size):
            out[i] += 1.0

    @njit
    def ser(out):
        for i in range(out.size):
            out[i] += 1.0

    o = np.zeros(8, np.float32)
    par(o)
    ser(o)
    best = {}
    for f in (par, ser):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(rounds):
                f(o)
            ts.append((time.perf_counter() - t0) / rounds)
        best[f] = min(ts)
    return 1e6 * max(best[par] - best[ser], 0.0)


def split(n_layer: int, n_tokens: int, n_steps: int, wall: float) -> dict:
    """Per-layer microseconds per step (decode) or per token (prefill) of each part."""
    kern = defaultdict(float)
    for (sec, _), s in T.kernel.items():
        kern[sec] += s
    excl = {s: T.incl[s] - T.child[s] for s in SECTIONS if s != "attn"}
    attn_excl = wall - sum(T.incl[s] for s in ("lookahead", "moe", "head"))
    div = n_layer * (n_steps if n_tokens == 1 else n_tokens)
    parts = {
        "attention kernels": kern["attn"],
        "attention python": attn_excl - kern["attn"],
        "lookahead (router predict)": T.incl["lookahead"],
        "router (matvec + top-k)": T.incl["router"],
        "expert kernels": kern["moe"],
        "expert read wait": T.incl["wait"],
        "moe python (scheduling, bookkeeping)": excl["moe"] - kern["moe"],
        "head (per layer share)": T.incl["head"],
    }
    out = {k: 1e6 * v / div for k, v in parts.items()}
    out["total"] = 1e6 * wall / div
    out["tokens per step"] = n_tokens
    out["router kernels"] = 1e6 * kern["router"] / div
    calls_div = n_layer * n_steps  # calls and launches: per layer per forward step
    out["parallel launches per layer"] = {sec: n / calls_div for sec, n in T.launches.items()}
    out["kernels"] = {
        f"{sec}/{name}": [T.calls[(sec, name)] / calls_div, 1e6 * t / div]
        for (sec, name), t in sorted(T.kernel.items())
    }
    return out


def print_split(title: str, r: dict, wake_us: float) -> None:
    print(f"\n{title}: microseconds per layer per {'step' if r['unit'] == 'step' else 'token'}")
    for k, v in r.items():
        if isinstance(v, float) and k not in ("total", "router kernels", "tokens per step"):
            share = 100 * v / r["total"] if r["total"] else 0
            print(f"  {k:<38} {v:9.1f}  {share:5.1f}%")
    print(f"  {'total':<38} {r['total']:9.1f}")
    launches = sum(r["parallel launches per layer"].values())
    print(
        f"  thread wake-ups (estimate, inside the kernel times): {launches:.1f} parallel launches per layer "
        f"per step x {wake_us:.1f} us = {launches * wake_us / r['tokens per step']:.1f} us per {r['unit']}"
    )
    print("  kernels (calls per layer per step, us per layer):")
    for k, (calls, us) in r["kernels"].items():
        print(f"    {k:<30} {calls:7.2f} calls {us:9.1f} us")


def _ms(xs: list[float]) -> str:
    return f"median {1e3 * statistics.median(xs):.2f} ms / best {1e3 * min(xs):.2f} ms ({1 / statistics.median(xs):.2f} / {1 / min(xs):.2f} tok/s)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--pp", type=int, default=32, help="prefill tokens")
    ap.add_argument("-n", "--tg", type=int, default=16, help="decode steps (greedy)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="run only the first N layers")
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="plain/instrumented rounds, alternating")
    ap.add_argument("--no-populate", action="store_true", help="do not read the used weights into RAM first")
    ap.add_argument("--json", default=None, help="write the splits as JSON here")
    ap.add_argument("--per-call", action="store_true", help="decode without kernels/decode.py's one-call blocks")
    a = ap.parse_args(argv)

    from streamer.bench import prompt_tokens
    from streamer.options import StreamOptions
    from streamer.pagein import PageIn
    from streamer.session import forward_order, open_model

    opts = StreamOptions(ram_budget=a.ram_budget, stream=not a.no_stream, learn=False)
    s = open_model(a.model, opts, n_ctx=a.pp + a.tg + 8, threads=a.threads)
    if s.moe is None:
        print("error: not a MoE model", file=sys.stderr)
        return 2
    m = s.model
    n_layer = len(m.layers)
    if a.layers:
        n_layer = min(a.layers, n_layer)
        m.layers = m.layers[:n_layer]
    if not a.no_populate:
        keep = [
            (t.offset, t.nbytes)
            for name, t in s.gf.tensors.items()
            if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer
            if "_exps." not in name or not s.streaming
        ]
        t0 = time.perf_counter()
        if s.pagein is not None:
            s.pagein.stop()  # open_model's background page-in of the whole file: only these layers are wanted
        PageIn(s.gf.mm, forward_order(s.gf, keep)).run()
        print(f"populated {sum(n for _, n in keep) / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s")
        if not s.streaming and hasattr(s.moe.source, "resident"):
            s.moe.source.resident()  # as Session.populate: every expert used is in RAM
    from streamer.session import advise_pages

    advise_pages(s.gf)
    if a.per_call:
        m._decode = None
    ids = prompt_tokens(s.cfg.n_vocab, a.pp)
    m.forward(ids[:4], m.new_state())  # compile / first touch

    def run() -> tuple[float, list[float]]:
        cache = m.new_state()
        t0 = time.perf_counter()
        logits = m.forward(ids, cache)
        t_pp = time.perf_counter() - t0
        tok, steps = int(np.argmax(logits)), []
        for _ in range(a.tg):
            t0 = time.perf_counter()
            logits = m.forward(np.array([tok]), cache)
            steps.append(time.perf_counter() - t0)
            tok = int(np.argmax(logits))
        return t_pp, steps

    instrument(s)
    plain, inst = [], []
    for _ in range(a.rounds):
        T.on = False
        plain.append(run())
        T.reset()
        cache = m.new_state()
        t0 = time.perf_counter()
        logits = m.forward(ids, cache)
        t_pp = time.perf_counter() - t0
        pp_split = split(n_layer, a.pp, 1, t_pp)
        pp_split["unit"] = "token"
        T.reset()
        tok, wall = int(np.argmax(logits)), 0.0
        for _ in range(a.tg):
            t0 = time.perf_counter()
            logits = m.forward(np.array([tok]), cache)
            wall += time.perf_counter() - t0
            tok = int(np.argmax(logits))
        tg_split = split(n_layer, 1, a.tg, wall)
        tg_split["unit"] = "step"
        T.on = False
        inst.append((t_pp, wall / a.tg, pp_split, tg_split))
    wake = launch_cost_us()
    pp_plain = statistics.median(p for p, _ in plain)
    tg_plain = statistics.median(statistics.median(st) for _, st in plain)
    # Like for like: the split below is the best instrumented round's MEAN step; `stream-run bench` reports the
    # mean step too. The median step of the plain rounds (above) ignores the slow steps a mean counts.
    plain_mean = [sum(st) / len(st) for _, st in plain]
    inst_mean = [r[1] for r in inst]
    print(
        f"\n{a.model}: {n_layer} of {s.cfg.n_layer} layers, {s.cfg.n_expert} experts, {s.cfg.n_expert_used} used, "
        f"{'streamed' if s.streaming else 'resident'}, threads {a.threads or 'default'}"
    )
    print(
        f"plain:        prefill {a.pp} tokens {pp_plain:.3f} s ({a.pp / pp_plain:.2f} tok/s), decode step "
        f"{1e3 * tg_plain:.2f} ms ({1 / tg_plain:.2f} tok/s), {1e6 * tg_plain / n_layer:.0f} us per layer"
    )
    best = min(inst, key=lambda r: r[1])
    print(
        f"instrumented: prefill {best[0]:.3f} s, decode step {1e3 * best[1]:.2f} ms "
        f"(timers add {100 * (best[1] / min(plain_mean) - 1):+.0f}%, best round vs best round)"
    )
    print(
        f"mean step per round (as `stream-run bench` times decode): plain {_ms(plain_mean)}, instrumented "
        f"{_ms(inst_mean)}; the split is the best instrumented round's"
    )
    print(f"parallel kernel launch cost (empty kernel, this process, now): {wake:.1f} us")
    print_split(f"decode ({a.tg} steps)", best[3], wake)
    print_split(f"prefill ({a.pp} tokens)", best[2], wake)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(
                    model=a.model,
                    layers=n_layer,
                    plain_pp_s=pp_plain,
                    plain_step_s=tg_plain,
                    launch_us=wake,
                    decode=best[3],
                    prefill=best[2],
                ),
                f,
                indent=1,
            )
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
