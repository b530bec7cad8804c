"""`stream-run inspect`: what is in a GGUF and what running it costs in memory."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from streamer.cli.options import CtxSize, ModelArg
from streamer.config import ModelConfig
from streamer.gguf_file import GGUFFile
from streamer.io import human


def inspect(
    model: ModelArg,
    ctx_size: CtxSize = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Metadata, tensor counts and bytes by type, resident vs expert bytes, KV bytes per token, the shards of a
    split model."""
    gf = GGUFFile(model)
    cfg = ModelConfig.from_gguf(gf)
    by_type: dict[str, list[int]] = {}
    expert = 0
    for t in gf.tensors.values():
        c = by_type.setdefault(t.type_name, [0, 0])
        c[0] += 1
        c[1] += t.nbytes
        if "_exps." in t.name:
            expert += t.nbytes
    total = sum(t.nbytes for t in gf.tensors.values())
    n_ctx = cfg.context(ctx_size)
    info = {
        "file": str(model),
        "file_bytes": gf.size,
        "config": cfg.__dict__,
        "tensors_by_type": {k: {"count": v[0], "bytes": v[1]} for k, v in sorted(by_type.items())},
        "resident_bytes": total - expert,
        "expert_bytes": expert,
        "expert_bytes_per_layer_expert": expert // max(cfg.n_layer * cfg.n_expert, 1),
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "kv_bytes_at_ctx": cfg.kv_bytes_per_token * n_ctx,
        "recurrent_state_bytes": cfg.recurrent_bytes,
        "ctx": n_ctx,
        "tokenizer": {
            k: gf.scalar(f"tokenizer.ggml.{k}", kind)
            for k, kind in (("model", str), ("pre", str), ("bos_token_id", int), ("eos_token_id", int))
        },
        "n_vocab_tokens": gf.array_len("tokenizer.ggml.tokens"),
        "shards": [{"file": sh.path, "bytes": sh.size, "tensors": sh.n_tensors} for sh in gf.shards],
    }
    if as_json:
        print(json.dumps(info))
        return
    c = cfg
    print(f"file      {model} ({human(gf.size)})")
    if len(gf.shards) > 1:
        for i, sh in enumerate(gf.shards):
            print(f"shard     {i + 1}/{len(gf.shards)} {sh.path} ({sh.n_tensors} tensors, {human(sh.size)})")
    print(
        f"arch      {c.arch}: {c.n_layer} layers, hidden {c.n_embd}, heads {c.n_head}/{c.n_head_kv} "
        f"(head_dim {c.head_dim}), vocab {c.n_vocab}, {'tied' if c.tied else 'untied'} head"
    )
    if c.full_attn_interval:
        n_lin = c.n_layer - c.n_attn_layers
        print(
            f"mixers    {c.n_attn_layers} gated attention (RoPE on {c.n_rot} of {c.head_dim} channels), {n_lin} Gated "
            f"DeltaNet ({c.ssm_k_heads}/{c.ssm_v_heads} heads of {c.ssm_head_dim}, conv {c.ssm_conv})"
            + (f"; {c.n_nextn} MTP block(s) not run" if c.n_nextn else "")
        )
    if c.is_moe:
        shared = f", shared expert ff {c.n_ff_shexp}" if c.n_ff_shexp else ""
        print(f"experts   {c.n_expert} per layer, {c.n_expert_used} used, expert ff {c.n_ff_exp}{shared}")
    else:
        print(f"ffn       {c.n_ff}")
    print(f"rope      theta {c.rope_theta:g}, context {c.n_ctx_train}, rms eps {c.rms_eps:g}")
    for k, v in info["tensors_by_type"].items():
        print(f"type      {k:<6} {v['count']:>5} tensors  {human(v['bytes']):>12}")
    print(f"resident  {human(total - expert)} (non-expert weights)")
    if c.is_moe:
        print(f"experts   {human(expert)} ({human(info['expert_bytes_per_layer_expert'])} per expert per layer)")
    print(f"kv cache  {human(c.kv_bytes_per_token)} per token, {human(info['kv_bytes_at_ctx'])} at -c {n_ctx}")
    if c.recurrent_bytes:
        print(f"recurrent {human(c.recurrent_bytes)} of state (conv windows and delta-rule matrices)")
    tk = info["tokenizer"]
    print(
        f"tokenizer {tk['model']}/{tk['pre']}, {info['n_vocab_tokens']} tokens, bos {tk['bos_token_id']}, "
        f"eos {tk['eos_token_id']}"
    )
