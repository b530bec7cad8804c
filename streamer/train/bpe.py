"""The models' own byte-level BPE tokenizer, trained with HF `tokenizers` exactly in Qwen2/Qwen3's shape
(the qwen2 split regex, then ByteLevel without its own regex; BPE without unknown token or byte fallback), with
the Qwen3 ChatML special tokens appended after the learned vocabulary. No NFC normaliser (Qwen's has one):
llama.cpp and stream-run normalise nothing, so without it all three agree on every text, not only NFC text."""

from __future__ import annotations

import json
from collections.abc import Iterable

import gguf

from streamer.synth.vocab import SPECIALS

# tokenizer.json of Qwen2/Qwen3 (pre_tokenizer.pretokenizers[0].pattern.Regex)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = SPECIALS[:3]  # <|endoftext|>, <|im_start|>, <|im_end|>: special=True in Qwen3's tokenizer.json
USER_DEFINED = SPECIALS[3:]  # <think>, </think>: special=False there, so llama.cpp's converter types them USER_DEFINED


def train_tokenizer(docs: Iterable[str], vocab_size: int):
    """A tokenizers.Tokenizer with vocab_size ids in all (learned tokens, then the 5 special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    return tok


def gguf_vocab(tokenizer_json: str) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, token types, merges as "a b") from a tokenizer.json, the way llama.cpp's
    convert_hf_to_gguf.py writes a Qwen3 vocabulary (added tokens CONTROL when special, else USER_DEFINED)."""
    tj = json.loads(tokenizer_json)
    vocab = dict(tj["model"]["vocab"])
    added = {a["id"]: a for a in tj["added_tokens"]}
    for i, a in added.items():
        vocab[a["content"]] = i
    n = len(vocab)
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    assert all(tokens), "token ids are not dense"
    types = [int(gguf.TokenType.NORMAL)] * n
    for i, a in added.items():
        types[i] = int(gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in tj["model"]["merges"]]
    return tokens, types, merges
