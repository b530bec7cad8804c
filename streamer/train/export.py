"""Write a trained Net as a GGUF the way llama.cpp's converter lays out Qwen3 / Qwen3-MoE: matrices Q8_0
(quantized by gguf-py), norms and the router F32, expert stacks as (expert, rows, cols), the tokenizer in
tokenizer.ggml.* (gpt2 model, qwen2 pre-tokenizer, ChatML template)."""

from __future__ import annotations

import os
import tempfile

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from streamer.io import current_umask
from streamer.synth.vocab import CHATML_TEMPLATE
from streamer.train.bpe import gguf_vocab


def _tensors(net):
    """(GGUF name, float32 array in numpy order, type)."""
    c = net.c

    def a(t):
        return t.detach().float().cpu().numpy().astype(np.float32)

    yield "token_embd.weight", a(net.embd.weight), T.Q8_0
    for i, b in enumerate(net.blocks):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", a(b.attn_norm), T.F32
        yield p + "attn_q.weight", a(b.attn.q.weight), T.Q8_0
        yield p + "attn_k.weight", a(b.attn.k.weight), T.Q8_0
        yield p + "attn_v.weight", a(b.attn.v.weight), T.Q8_0
        yield p + "attn_output.weight", a(b.attn.o.weight), T.Q8_0
        yield p + "attn_q_norm.weight", a(b.attn.q_norm), T.F32
        yield p + "attn_k_norm.weight", a(b.attn.k_norm), T.F32
        yield p + "ffn_norm.weight", a(b.ffn_norm), T.F32
        if c.is_moe:
            yield p + "ffn_gate_inp.weight", a(b.ffn.router.weight), T.F32
            yield p + "ffn_gate_exps.weight", a(b.ffn.gate), T.Q8_0
            yield p + "ffn_up_exps.weight", a(b.ffn.up), T.Q8_0
            yield p + "ffn_down_exps.weight", a(b.ffn.down), T.Q8_0
        else:
            yield p + "ffn_gate.weight", a(b.ffn.gate.weight), T.Q8_0
            yield p + "ffn_up.weight", a(b.ffn.up.weight), T.Q8_0
            yield p + "ffn_down.weight", a(b.ffn.down.weight), T.Q8_0
    yield "output_norm.weight", a(net.out_norm), T.F32
    yield "output.weight", a(net.head.weight), T.Q8_0


def write_gguf(net, tokenizer_json: str, path: str, name: str) -> str:
    c = net.c
    arch = "qwen3moe" if c.is_moe else "qwen3"
    path = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".part")
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        w.add_block_count(c.n_layer)
        w.add_context_length(c.n_ctx)
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(c.n_ff if not c.is_moe else c.n_ff_exp * c.n_expert_used)
        w.add_head_count(c.n_head)
        w.add_head_count_kv(c.n_head_kv)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_eps)
        w.add_rope_freq_base(c.rope_theta)
        if c.is_moe:
            w.add_expert_count(c.n_expert)
            w.add_expert_used_count(c.n_expert_used)
            w.add_expert_feed_forward_length(c.n_ff_exp)
        tokens, types, merges = gguf_vocab(tokenizer_json)
        assert len(tokens) == c.n_vocab, (len(tokens), c.n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        ids = {t: i for i, t in enumerate(tokens)}
        w.add_bos_token_id(ids["<|endoftext|>"])  # Qwen3: bos = pad = <|endoftext|>, not added
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_eot_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
        for tname, arr, qt in _tensors(net):
            if qt == T.F32:
                w.add_tensor(tname, arr)
            else:
                w.add_tensor(tname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
