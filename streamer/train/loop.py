"""The training loop: seeded, resumable (an atomic checkpoint every few minutes; a restarted run continues
from it and draws the same batches, since each step's batch comes from its own seeded generator)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from streamer.train.nets import Net, NetConfig


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch: int
    seq: int
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    aux_coef: float = 0.01  # Switch-style load balancing (Qwen3 ships router_aux_loss_coef 0.001 at 128 experts)
    seed: int = 0
    checkpoint_s: float = 180.0
    log_every: int = 10
    # further cosine cycles after the first (steps, peak lr), each with its own warmup: a warm restart (SGDR)
    # that lets a finished run be trained on, with a schedule a fresh run reproduces step for step
    cycles: tuple[tuple[int, float], ...] = ()

    @property
    def total_steps(self) -> int:
        return self.steps + sum(n for n, _ in self.cycles)


def _cosine(step: int, steps: int, lr: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(tc: TrainConfig, step: int) -> float:
    if step < tc.steps:
        return _cosine(step, tc.steps, tc.lr, tc.warmup, tc.min_lr_frac)
    step -= tc.steps
    for n, lr in tc.cycles:
        if step < n:
            return _cosine(step, n, lr, min(tc.warmup, n // 10), tc.min_lr_frac)
        step -= n
    return tc.lr * tc.min_lr_frac


def batch_at(tokens: np.ndarray, tc: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng([tc.seed, step])
    starts = rng.integers(0, len(tokens) - tc.seq - 1, size=tc.batch)
    idx = starts[:, None] + np.arange(tc.seq + 1)[None, :]
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def _save(path: str, obj) -> None:
    tmp = path + ".part"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(nc: NetConfig, tc: TrainConfig, tokens: np.ndarray, ckpt: str, log=print) -> Net:
    torch.manual_seed(tc.seed)
    net = Net(nc)
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2 and "router" not in n]
    rest = [p for n, p in net.named_parameters() if not (p.dim() >= 2 and "router" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )
    step = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, weights_only=False)
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        log(f"resumed from {ckpt} at step {step}")
    n_param = sum(p.numel() for p in net.parameters())
    log(f"model {nc}\nparameters {n_param / 1e6:.2f} M; {tc}")
    last_ckpt = t0 = time.time()
    acc_loss, acc_aux, acc_n = 0.0, 0.0, 0
    usage = torch.zeros(nc.n_layer, max(nc.n_expert, 1))
    while step < tc.total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(tc, step)
        x, y = batch_at(tokens, tc, step)
        logits, extras = net(x)
        loss = F.cross_entropy(logits.reshape(-1, nc.n_vocab), y.reshape(-1))
        total = loss
        if nc.is_moe:
            aux = torch.stack([e[0] for e in extras]).mean()
            total = loss + tc.aux_coef * aux
            acc_aux += aux.item()
            for i, e in enumerate(extras):
                usage[i] += e[1].float()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        acc_loss += loss.item()
        acc_n += 1
        if step % tc.log_every == 0 or step == tc.total_steps:
            dt = time.time() - t0
            msg = (
                f"step {step}/{tc.total_steps} loss {acc_loss / acc_n:.4f} lr {lr_at(tc, step - 1):.2e} "
                f"tok/s {acc_n * tc.batch * tc.seq / dt:.0f}"
            )
            if nc.is_moe:
                share = usage / usage.sum(1, keepdim=True)
                msg += f" aux {acc_aux / acc_n:.3f} top-expert share {share.max(1).values.mean():.3f}"
                usage.zero_()
            log(msg)
            acc_loss, acc_aux, acc_n, t0 = 0.0, 0.0, 0, time.time()
            sys.stdout.flush()
        if time.time() - last_ckpt > tc.checkpoint_s or step == tc.total_steps:
            _save(ckpt, {"model": net.state_dict(), "opt": opt.state_dict(), "step": step, "net": nc.to_dict()})
            last_ckpt = time.time()
    return net


@torch.no_grad()
def eval_loss(net: Net, ids: np.ndarray, ctx: int) -> float:
    """Mean next-token loss over non-overlapping windows of ctx tokens (every position scored)."""
    net.eval()
    tot, n = 0.0, 0
    for s in range(0, len(ids) - ctx, ctx):
        chunk = torch.from_numpy(ids[s : s + ctx + 1].astype(np.int64))[None]
        logits, _ = net(chunk[:, :-1])
        tot += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n += ctx
    net.train()
    return tot / max(n, 1)
