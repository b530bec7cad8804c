#!/usr/bin/env python
"""Run llama.cpp (llama-cpp-python) on one GGUF and print ONE JSON line: speed, disk reads, peak RSS.

Runs under the llama.cpp venv (default /opt/llamavenv/bin/python), never the project's: it imports only
llama_cpp, numpy and psutil, so the project never depends on llama-cpp-python.

    /opt/llamavenv/bin/python bench/llama_run.py MODEL.gguf --threads 2 --pp 128 --tg 64 [--no-repack]
    /opt/llamavenv/bin/python bench/llama_run.py MODEL.gguf --logits-tokens 1,2,3 --logits-out L.npy

Benchmark mode: load, warm-up (prefill of min(pp, 16) prompt tokens + one greedy token; this is also the
time-to-first-token measurement), clear the KV cache, prefill pp tokens (timed, including picking the
first token), then greedy decode until tg tokens exist: tg - 1 timed single-token steps, counted the way
`stream-run bench` counts them (`tokens` holds the tg greedy ids; tg_tok_s = (tg - 1) / time). Disk reads
(psutil io_counters().read_bytes: what really came from storage) are reported per phase; peak RSS is
getrusage's ru_maxrss (the kernel's high-water mark, which counts resident mmap pages of the model file).

Logits mode (teacher forcing): one eval of the whole token sequence with logits_all=True; writes the
float32 per-position logits (n_tokens, n_vocab) to --logits-out.

llama-cpp-python 0.3.36 notes (read from llama_cpp/llama.py and llama_cpp.py):
  * `Llama(...)` has NO `use_extra_bufts` keyword. Unknown keywords are swallowed by `**kwargs`, so
    `Llama(path, use_extra_bufts=False)` silently keeps repacking ON. The flag is a field of the C struct
    `llama_model_params` (`use_extra_bufts`, default True: "use extra buffer types (used for weight
    repacking)"), which Llama.__init__ builds from `llama_cpp.llama_model_default_params()`. --no-repack
    therefore wraps that function so the struct it returns has use_extra_bufts=False; the JSON records
    the value the loaded model really used and the loader's buffer lines (a "CPU_REPACK" buffer = repacked).
  * The same struct has `lazy_mode` (OFF=0, AUTO=1 default: "lazy only for marked tensors larger than
    4 GiB (requires mmap)", ON=2: "read the rows of tensors marked by the arch on demand"), also not a
    Llama() keyword. --lazy-mode sets it the same way; the default leaves llama.cpp's own default. With
    lazy_mode=on a tiny qwen3moe file logged no "lazy read enabled" tensor: the arch marks none.
  * use_mmap=True becomes load_mode=LLAMA_LOAD_MODE_MMAP (Llama() always overwrites load_mode from
    use_mmap/use_mlock, so LLAMA_LOAD_MODE_DIRECT_IO is not reachable through it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import time

T_START = time.perf_counter()

import numpy as np  # noqa: E402
import psutil  # noqa: E402

LAZY_MODES = {"off": 0, "auto": 1, "on": 2}


def parse_tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def default_prompt(n: int, n_vocab: int, seed: int = 1234) -> list[int]:
    """The prompt `stream-run bench` uses (streamer.bench.prompt_tokens, copied because this venv cannot
    import the project): pseudo-random ids over the whole vocabulary, like llama-bench's random tokens."""
    return np.random.default_rng(seed).integers(0, n_vocab, size=n, dtype=np.int64).tolist()


class LogCapture:
    """Keep llama.cpp's log lines that say how weights were placed (buffers, repack, lazy reads); echo all
    lines to stderr when verbose."""

    KEEP = ("buffer size", "repack", "REPACK", "lazy", "mmap", "direct", "error", "failed")

    def __init__(self, verbose: bool):
        import llama_cpp

        self.lines: list[str] = []
        self.verbose = verbose
        self._partial = ""

        @llama_cpp.llama_log_callback
        def cb(level, text, user_data):
            s = text.decode("utf-8", "replace")
            if verbose:
                sys.stderr.write(s)
            self._partial += s
            while "\n" in self._partial:
                line, self._partial = self._partial.split("\n", 1)
                if any(k in line for k in self.KEEP):
                    self.lines.append(line.strip())

        self._cb = cb  # keep a reference: ctypes callbacks must outlive their registration
        llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))


def versions() -> dict:
    import llama_cpp

    out = {"llama_cpp_python": llama_cpp.__version__, "llama_cpp": llama_cpp.llama_version().decode()}
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        lib.ggml_version.restype = ctypes.c_char_p
        lib.ggml_commit.restype = ctypes.c_char_p
        out["ggml"] = lib.ggml_version().decode()
        out["ggml_commit"] = lib.ggml_commit().decode()
    except (OSError, AttributeError):
        pass
    return out


def load(path: str, args, n_ctx: int, logits_all: bool):
    """Llama(...) with use_extra_bufts / lazy_mode / load_mode set on the C params struct (see module doc)."""
    import llama_cpp
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = not args.no_repack
        if args.lazy_mode != "default":
            p.lazy_mode = LAZY_MODES[args.lazy_mode]
        return p

    C.llama_model_default_params = params
    try:
        m = llama_cpp.Llama(
            path,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_ctx=n_ctx,
            n_batch=args.n_batch,
            n_ubatch=args.n_batch,
            logits_all=logits_all,
            use_mmap=not args.no_mmap,
            verbose=args.verbose,
            seed=0,
        )
    finally:
        C.llama_model_default_params = orig
    return m


def argmax_last(m) -> int:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(m.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(m.n_vocab(),))))


def step_quantiles(steps: list[float]) -> dict | None:
    """{min, median, p90, max} of the step times in ms (stream-run bench's tg_step_ms), or None without a step."""
    if not steps:
        return None
    q = np.quantile(np.array(steps) * 1e3, [0.0, 0.5, 0.9, 1.0])
    return {k: round(float(v), 3) for k, v in zip(("min", "median", "p90", "max"), q)}


def read_bytes(proc) -> int:
    return int(proc.io_counters().read_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens to prefill (timed)")
    ap.add_argument("--tg", type=int, default=64, help="greedy tokens to produce (tg - 1 timed decode steps)")
    ap.add_argument("--prompt-tokens", help="comma-separated prompt ids (default: stream-run bench's prompt)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up; ttft_s then covers the pp prefill")
    ap.add_argument("--no-repack", action="store_true", help="llama_model_params.use_extra_bufts=False")
    ap.add_argument(
        "--lazy-mode",
        choices=["default", *LAZY_MODES],
        default="default",
        help="llama_model_params.lazy_mode (default: leave llama.cpp's default, AUTO)",
    )
    ap.add_argument("--no-mmap", action="store_true", help="use_mmap=False (read the whole file into RAM)")
    ap.add_argument("--n-ctx", type=int, default=0, help="context size (default: pp+tg+32, rounded up to 256)")
    ap.add_argument("--n-batch", type=int, default=512, help="n_batch = n_ubatch")
    ap.add_argument("--logits-tokens", help="teacher-forcing mode: comma-separated ids; write per-position logits")
    ap.add_argument("--logits-out", help="with --logits-tokens: output .npy (float32, (n_tokens, n_vocab))")
    ap.add_argument("--verbose", action="store_true", help="echo llama.cpp's log to stderr")
    args = ap.parse_args(argv)

    proc = psutil.Process()
    log = LogCapture(args.verbose)
    res: dict = {
        "tool": "llama.cpp",
        "model": os.path.abspath(args.model),
        "model_bytes": os.path.getsize(args.model),
        "n_threads": args.threads,
        "repack": not args.no_repack,
        "lazy_mode": args.lazy_mode,
        "use_mmap": not args.no_mmap,
        "versions": versions(),
    }
    rb0 = read_bytes(proc)

    if args.logits_tokens:
        ids = parse_tokens(args.logits_tokens)
        n_ctx = max(256, -(-len(ids) // 256) * 256)
        args.n_batch = max(args.n_batch, len(ids))  # one eval, one ubatch
        t0 = time.perf_counter()
        m = load(args.model, args, n_ctx, logits_all=True)
        res["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.eval(ids)
        res["eval_s"] = time.perf_counter() - t0
        logits = np.array(m.scores[: len(ids)], dtype=np.float32)
        if args.logits_out:
            np.save(args.logits_out, logits)
        res.update(
            n_ctx=n_ctx,
            n_tokens=len(ids),
            n_vocab=m.n_vocab(),
            logits_out=args.logits_out,
            use_extra_bufts=bool(m.model_params.use_extra_bufts),
            lazy_mode_value=int(m.model_params.lazy_mode),
        )
    else:
        n_ctx = args.n_ctx or -(-(args.pp + args.tg + 32) // 256) * 256
        t0 = time.perf_counter()
        m = load(args.model, args, n_ctx, logits_all=False)
        res["load_s"] = time.perf_counter() - t0
        rb_load = read_bytes(proc)
        n_vocab = m.n_vocab()
        prompt = parse_tokens(args.prompt_tokens) if args.prompt_tokens else default_prompt(args.pp, n_vocab)
        prompt = prompt[: args.pp]
        rb_warm = rb_load
        if not args.no_warmup:
            w = prompt[: min(len(prompt), 16)]
            m.eval(w)
            argmax_last(m)
            res["ttft_s"] = time.perf_counter() - t0  # load + short prefill + first token, from Llama() call
            res["ttft_prompt_tokens"] = len(w)
            m.reset()  # n_tokens = 0: the next eval removes every KV cell (kv_cache_seq_rm(-1, 0, -1))
            rb_warm = read_bytes(proc)
        t1 = time.perf_counter()
        m.eval(prompt)
        tok = argmax_last(m)
        t2 = time.perf_counter()
        if args.no_warmup:
            res["ttft_s"] = t2 - t0
            res["ttft_prompt_tokens"] = len(prompt)
        rb_pp = read_bytes(proc)
        toks = [tok]
        steps = []  # each decode step's seconds, as stream-run bench's tg_step_ms
        for _ in range(args.tg - 1):  # the first of the tg tokens came from the prefill's logits
            ts = time.perf_counter()
            m.eval([tok])
            tok = argmax_last(m)
            steps.append(time.perf_counter() - ts)
            toks.append(tok)
        t3 = time.perf_counter()
        rb_tg = read_bytes(proc)
        n_dec = max(args.tg - 1, 0)
        res.update(
            pp=len(prompt),
            tg=args.tg,
            n_ctx=n_ctx,
            n_batch=args.n_batch,
            n_vocab=n_vocab,
            pp_s=t2 - t1,
            pp_tok_s=len(prompt) / (t2 - t1),
            tg_s=t3 - t2,
            tg_decode_steps=n_dec,
            tg_tok_s=(n_dec / (t3 - t2)) if n_dec else None,
            tg_step_ms=step_quantiles(steps),
            tokens=toks,
            read_bytes_load=rb_load - rb0,
            read_bytes_warmup=rb_warm - rb_load,
            read_bytes_pp=rb_pp - rb_warm,
            read_bytes_tg=rb_tg - rb_pp,
            read_bytes_per_token=(rb_tg - rb_pp) / n_dec if n_dec else None,
            use_extra_bufts=bool(m.model_params.use_extra_bufts),
            lazy_mode_value=int(m.model_params.lazy_mode),
        )
    res["disk_read_bytes"] = read_bytes(proc) - rb0
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res["rss_bytes_end"] = proc.memory_info().rss
    res["wall_s"] = time.perf_counter() - T_START
    res["load_log"] = log.lines
    sys.stdout.flush()
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
