#!/usr/bin/env python
"""llama.cpp's teacher-forced logits over perplexity windows (runs under the llama.cpp venv, never the project's).

    /opt/llamavenv/bin/python bench/llama_logits.py MODEL.gguf --windows W.npy --first F --out L.npy \
        [--text FILE --tokens-out T.npy] [--threads 2]

W.npy: int64 (n_windows, n_ctx) token ids. Each window is evaluated from position 0 in an empty KV cache (as
llama-perplexity does), with logits for every position; L.npy gets float32 (n_windows, n_ctx - 1 - F, n_vocab):
the logits at positions F .. n_ctx - 2, the ones llama-perplexity scores. With --text, llama.cpp's own
tokenization of the file (no BOS, no special-token parsing: common_tokenize(..., add_special, parse_special=false)
as llama-perplexity) goes to --tokens-out, so the caller can check both tokenizers agree.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--windows", required=True)
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text")
    ap.add_argument("--tokens-out")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from llama_cpp import Llama

    w = np.load(a.windows)
    n_win, n_ctx = w.shape
    m = Llama(
        a.model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        verbose=False,
    )
    out = np.empty((n_win, n_ctx - 1 - a.first, m.n_vocab()), np.float32)
    for i in range(n_win):
        m.reset()
        m.eval(w[i].tolist())
        out[i] = np.asarray(m.scores[a.first : n_ctx - 1], dtype=np.float32)
    np.save(a.out, out)
    info = {"windows": n_win, "n_ctx": n_ctx, "n_vocab": m.n_vocab(), "add_bos": m._model.add_bos_token()}
    if a.text:
        with open(a.text, "rb") as f:
            ids = m.tokenize(f.read(), add_bos=info["add_bos"], special=False)
        np.save(a.tokens_out, np.asarray(ids, np.int64))
        info["n_tokens"] = len(ids)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
