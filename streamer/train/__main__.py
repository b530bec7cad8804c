"""python -m streamer.train {prepare,train,export,all} ... (see streamer/train/__init__.py). tokenizers and torch,
optional (the train extra), are imported by the steps that use them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import numpy as np

from streamer.io import atomic_save_npy, atomic_write
from streamer.train import corpus
from streamer.train.bpe import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "tests" / "data" / "heldout_stdlib.py.txt"
TOKENIZER_JSON = REPO / "tests" / "data" / "stdlib_bpe_tokenizer.json"

# name -> (NetConfig kwargs, TrainConfig kwargs)
MODELS = {
    "moe": (
        dict(n_layer=8, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_expert=64, n_expert_used=8, n_ff_exp=64),
        dict(steps=400, batch=8, seq=256, lr=3e-3, cycles=((300, 1.5e-3),)),
    ),
    "dense": (
        dict(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=384),
        dict(steps=450, batch=8, seq=256, lr=3e-3, cycles=((300, 1.5e-3),)),
    ),
}
FILES = {"moe": "stdlib-qwen3moe-q8_0.gguf", "dense": "stdlib-qwen3-q8_0.gguf"}
VOCAB = 4096


def log_to(path: Path):
    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    return log


def prepare(work: Path, log) -> None:
    from tokenizers import Tokenizer

    def atomic_write_text(path, text):
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))

    files = corpus.stdlib_files()
    train_docs, held = corpus.split(files)
    log(
        f"corpus {corpus.stdlib_dir()}: {len(files)} files, {len(train_docs)} for training "
        f"({sum(len(t) for t in train_docs) / 1e6:.1f} M chars), {len(held)} held out"
    )
    HELDOUT.parent.mkdir(parents=True, exist_ok=True)
    if not HELDOUT.exists():
        atomic_write_text(HELDOUT, corpus.heldout_text(held))
    if TOKENIZER_JSON.exists():
        tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    else:
        tok = train_tokenizer(train_docs, VOCAB)
        atomic_write_text(TOKENIZER_JSON, tok.to_str(pretty=True))
    out = work / "train_tokens.npy"
    if not out.exists():
        eot = tok.token_to_id("<|endoftext|>")
        ids = []
        for enc in tok.encode_batch(train_docs):
            ids.extend(enc.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.uint16)
        atomic_save_npy(out, arr)
        log(f"training tokens: {len(arr)} ({sum(len(t) for t in train_docs) / len(arr):.2f} chars/token)")


def heldout_ids() -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    return np.asarray(tok.encode(HELDOUT.read_text(encoding="utf-8")).ids, dtype=np.int64)


def unigram_ppl(train: np.ndarray, held: np.ndarray, n_vocab: int) -> float:
    counts = np.bincount(train, minlength=n_vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    return math.exp(-logp[held].mean())


def train_model(name: str, work: Path, log, steps: int | None) -> None:
    import torch

    from streamer.train.loop import TrainConfig, eval_loss, train
    from streamer.train.nets import NetConfig

    # One thread by default: on a shared machine two OpenMP threads wait on each other whenever one is descheduled
    # (measured here under load ~9: 30 s per step with 2 threads, 3 s with 1).
    torch.set_num_threads(int(os.environ.get("TRAIN_THREADS", "1")))
    nk, tk = MODELS[name]
    nc = NetConfig(n_vocab=VOCAB, **nk)
    tc = TrainConfig(**{**tk, **({"steps": steps} if steps else {})})
    tokens = np.load(work / "train_tokens.npy")
    t0 = time.time()
    net = train(nc, tc, tokens, str(work / f"{name}.ckpt"), log=log)
    log(f"{name}: training finished ({time.time() - t0:.0f} s in this process)")
    held = heldout_ids()
    loss = eval_loss(net, held[: 32 * 256 + 1], 256)
    log(
        f"{name}: held-out loss {loss:.4f} ppl {math.exp(loss):.2f} (first 32 windows of 256, all positions); "
        f"unigram ppl {unigram_ppl(tokens, held, VOCAB):.2f}"
    )


def export_model(name: str, work: Path, out: Path, log) -> None:
    import torch

    from streamer.train.export import write_gguf
    from streamer.train.nets import Net, NetConfig

    st = torch.load(work / f"{name}.ckpt", weights_only=False)
    net = Net(NetConfig(**st["net"]))
    # the file's context_length: the window the model was trained on
    net.c = dataclasses.replace(net.c, n_ctx=MODELS[name][1]["seq"])
    net.load_state_dict(st["model"])
    out.mkdir(parents=True, exist_ok=True)
    p = write_gguf(
        net,
        TOKENIZER_JSON.read_text(encoding="utf-8"),
        str(out / FILES[name]),
        f"stream-run stdlib {'Qwen3-MoE' if net.c.is_moe else 'Qwen3'} (step {st['step']})",
    )
    log(f"wrote {p} ({os.path.getsize(p) / 1e6:.1f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m streamer.train")
    ap.add_argument("stage", choices=["prepare", "train", "export", "all"])
    ap.add_argument("--model", choices=[*MODELS, "both"], default="both")
    ap.add_argument("--work", type=Path, default=Path("/tmp/stream-run-train"))
    ap.add_argument("--out", type=Path, default=REPO / "streamer" / "models")
    ap.add_argument("--steps", type=int, default=None, help="override the training steps (tests of the script)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    log = log_to(a.work / "train.log")
    names = list(MODELS) if a.model == "both" else [a.model]
    if a.stage in ("prepare", "all"):
        prepare(a.work, log)
    for n in names:
        if a.stage in ("train", "all"):
            train_model(n, a.work, log, a.steps)
        if a.stage in ("export", "all"):
            export_model(n, a.work, a.out, log)


if __name__ == "__main__":
    main()
