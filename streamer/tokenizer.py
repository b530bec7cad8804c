"""Byte-level BPE tokenizer built from a GGUF's own tokenizer.* metadata, mirroring llama.cpp (llama-vocab.cpp).

encode: special-token partition (CONTROL / USER_DEFINED / UNKNOWN texts, longest first) -> qwen2 (or qwen35) split
-> GPT-2 byte-to-unicode mapping -> BPE by merge rank, always the lowest rank and then the leftmost pair,
one merge at a time (llm_tokenizer_bpe_session). No Unicode normalisation: llama.cpp does none, while HF
applies NFC first, so the two agree on NFC text only.
decode: NORMAL tokens map back through the byte table; CONTROL / USER_DEFINED / UNKNOWN render their text;
UNUSED / BYTE / UNDEFINED render nothing (llama.cpp token_to_piece for BPE vocabularies).
"""

from __future__ import annotations

import codecs
import heapq
import re
import sys
import warnings

import numpy as np
from gguf import TokenType
from gguf.constants import Keys

from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.pretokenize import QWEN2_PRE, QWEN35_PRE, partition_specials, split_words

K = Keys.Tokenizer
_NORMAL, _UNKNOWN, _CONTROL, _USER = (
    int(TokenType.NORMAL),
    int(TokenType.UNKNOWN),
    int(TokenType.CONTROL),
    int(TokenType.USER_DEFINED),
)
_NO_RANK = sys.maxsize
_HEAP_FROM = 64  # words at least this long use the heap merge loop (the list scan is O(n^2))
_CACHE_MAX = 1 << 18

# Token texts llama.cpp treats as end-of-generation (llama_vocab::impl::load), and the FIM pad / repo /
# file-separator texts it also adds to its EOG set. It forces all of them to CONTROL.
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        "[PAD]",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        "<|file_sep|>",
    ]
)
# FIM prefix / suffix / middle texts: llama.cpp forces these to CONTROL too (they are not EOG).
FIM_TEXTS = frozenset(
    [
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ]
)
_warned: set[str] = set()
_SURROGATE = re.compile("[\ud800-\udfff]")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (unicode.cpp unicode_byte_to_utf8_map)."""
    bs = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_B2U = byte_to_unicode()
_U2B = {c: b for b, c in _B2U.items()}
_LATIN1_TO_BL = str.maketrans({chr(b): c for b, c in _B2U.items()})


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


class Tokenizer:
    """Encode/decode with the vocabulary, merges and special-token policy stored in one GGUF file."""

    def __init__(
        self,
        tokens: list[str],
        types,
        merges,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        eog_extra: tuple[int | None, ...] = (),
        model: str = "gpt2",
        pre: str = "qwen2",
        source: str = "tokenizer",
    ):
        n = len(tokens)
        if "" in tokens:  # as llama.cpp does
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._tokens = tokens
        self._tok2id: dict[str, int] = dict(zip(tokens, range(n)))
        if len(self._tok2id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise StreamerError(f"{source}: duplicate token {t!r} in the vocabulary (ids {seen[t]} and {i})")
                seen[t] = i
        types = np.full(n, _NORMAL, np.int32) if types is None else np.array(types, dtype=np.int32)
        if len(types) != n:
            raise StreamerError(f"{source}: {len(types)} token types for {n} tokens")
        self._types = types
        self._merges = merges  # list[str] or a zero-argument callable returning it (decoded lazily)
        self._ranks: dict[str, int] | None = None
        self.n_vocab = n
        for name, v in (("bos", bos_id), ("eos", eos_id)):
            if v is not None and not 0 <= v < n:
                raise StreamerError(f"{source}: {name} token id {v} is out of range (vocabulary has {n} tokens)")
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        if self.add_bos and bos_id is None:
            raise StreamerError(f"{source}: {K.ADD_BOS} is true but {K.BOS_ID} is not set")
        if self.add_eos and eos_id is None:
            raise StreamerError(f"{source}: {K.ADD_EOS} is true but {K.EOS_ID} is not set")
        self.chat_template = chat_template
        self._source = source
        eog = {self._tok2id[t] for t in EOG_TEXTS if t in self._tok2id}
        self._types[[self._tok2id[t] for t in EOG_TEXTS | FIM_TEXTS if t in self._tok2id]] = _CONTROL
        eog.update(i for i in (eos_id, *eog_extra) if i is not None and 0 <= i < n)
        self.eog_ids: frozenset[int] = frozenset(eog)
        special = np.flatnonzero(np.isin(self._types, (_CONTROL, _USER, _UNKNOWN)))
        # llama.cpp sorts by byte length, longest first; ties keep id order here (std::sort leaves them open).
        self._specials = sorted(
            ((tokens[i], int(i)) for i in special), key=lambda s: -len(s[0].encode("utf-8", "surrogateescape"))
        )
        self._bytes: list[bytes | None] = [None] * n
        self._cache: dict[str, tuple[int, ...]] = {}
        self._marks = pre in QWEN35_PRE  # qwen35's split: combining marks stay in letter runs
        if model != "gpt2":
            _warn_once(
                f"{source}: tokenizer model {model!r} is not 'gpt2' (byte-level BPE); "
                "encoding it as byte-level BPE, parity with llama.cpp is not guaranteed"
            )
        elif pre not in QWEN2_PRE + QWEN35_PRE:
            _warn_once(
                f"{source}: pre-tokenizer {pre!r} is neither qwen2 nor qwen35; splitting with the qwen2 pattern, "
                "parity with llama.cpp is not guaranteed"
            )

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Tokenizer:
        """Vocabulary and policy from gf's tokenizer.* keys. The merges are decoded on the first encode.
        Every key must have its GGUF type (llama.cpp refuses a key of the wrong type too)."""
        if K.LIST not in gf.fields:
            raise StreamerError(f"{gf.path} has no tokenizer vocabulary ({K.LIST})")
        tokens = gf.get_strings(K.LIST, errors="surrogateescape")
        for key, kind in ((K.TOKEN_TYPE, int), (K.SCORES, float)):
            arr = gf.array(key, kind)
            if arr is not None and len(arr) != len(tokens):
                raise StreamerError(f"{gf.path}: {key} has {len(arr)} entries for {len(tokens)} tokens")
        merges = None
        if K.MERGES in gf.fields:
            gf.string_count(K.MERGES)  # an array of strings, checked now; decoded on the first encode

            def merges():  # `gf` must stay open until then
                if gf.mm is None:
                    raise StreamerError(f"{gf.path} was closed before the tokenizer read its merges")
                return gf.get_strings(K.MERGES, errors="surrogateescape")

        model = gf.scalar(K.MODEL, str, "")
        if merges is None:
            if model == "gpt2":
                raise StreamerError(f"{gf.path} has no BPE merges ({K.MERGES})")
            merges = []
        eog_keys = (K.EOT_ID, K.EOM_ID, K.FIM_PAD_ID, K.FIM_REP_ID, K.FIM_SEP_ID)
        return cls(
            tokens,
            gf.array(K.TOKEN_TYPE, int),
            merges,
            bos_id=gf.scalar(K.BOS_ID, int),
            eos_id=gf.scalar(K.EOS_ID, int),
            add_bos=gf.scalar(K.ADD_BOS, bool, False),
            add_eos=gf.scalar(K.ADD_EOS, bool, False),
            chat_template=gf.scalar(K.CHAT_TEMPLATE, str),
            eog_extra=tuple(gf.scalar(k, int) for k in eog_keys),
            model=model,
            pre=gf.scalar(K.PRE, str, ""),
            source=gf.path,
        )

    # ---- encode ----
    def encode(self, text: str) -> list[int]:
        """Token ids with the model's BOS/EOS policy (tokenizer.ggml.add_bos_token / add_eos_token)."""
        ids = self.encode_raw(text)
        if self.add_bos:
            ids.insert(0, self.bos_id)
        if self.add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_raw(self, text: str) -> list[int]:
        """Token ids with special-token texts resolved to their ids, no BOS/EOS added."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates, e.g. argv bytes that were not UTF-8 (surrogateescape): llama.cpp turns each
            # byte it cannot decode into U+FFFD, so each surrogate becomes one U+FFFD here.
            text = _SURROGATE.sub("\ufffd", text)
        out: list[int] = []
        for frag in partition_specials(text, self._specials):
            if isinstance(frag, int):
                out.append(frag)
            else:
                self._encode_words(frag, out)
        return out

    def _encode_words(self, text: str, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > _CACHE_MAX:
            cache.clear()
        for word in split_words(text, self._marks):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._bpe(word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BL))
            out.extend(ids)

    def _rank_table(self) -> dict[str, int]:
        """Merge "a b" -> rank. llama.cpp keys the pair split at the first space after position 0; BPE
        symbols are non-empty and never contain a space (byte 0x20 is U+0120), so the joined string is the
        same key. The first occurrence of a duplicate wins, as with std::unordered_map::emplace."""
        if self._ranks is None:
            merges = self._merges() if callable(self._merges) else self._merges
            for i, m in enumerate(merges):
                if not 0 < m.find(" ", 1) < len(m) - 1:  # where llama.cpp splits the pair
                    raise StreamerError(f"{self._source}: BPE merge #{i} {m!r} is not two symbols separated by a space")
            self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            self._merges = None
        return self._ranks

    def _bpe(self, word: str) -> tuple[int, ...]:
        """BPE of one byte-level word: lowest merge rank first, leftmost on ties, one merge at a time."""
        ranks = self._ranks if self._ranks is not None else self._rank_table()
        if len(word) >= _HEAP_FROM:
            syms = self._bpe_heap(word, ranks)
        else:
            syms = list(word)
            get = ranks.get
            pr = [get(f"{a} {b}", _NO_RANK) for a, b in zip(syms, syms[1:])]
            while pr:
                best = min(pr)
                if best == _NO_RANK:
                    break
                i = pr.index(best)
                syms[i : i + 2] = [syms[i] + syms[i + 1]]
                del pr[i]
                if i < len(pr):
                    pr[i] = get(f"{syms[i]} {syms[i + 1]}", _NO_RANK)
                if i > 0:
                    pr[i - 1] = get(f"{syms[i - 1]} {syms[i]}", _NO_RANK)
        return self._ids_of(syms)

    @staticmethod
    def _bpe_heap(word: str, ranks: dict[str, int]) -> list[str]:
        """Same merges as the list scan, with a heap and a linked list, for long words (O(n log n))."""
        syms = list(word)
        nxt = [*range(1, len(syms)), -1]
        prv = list(range(-1, len(syms) - 1))
        heap = [(r, i) for i in range(len(syms) - 1) if (r := ranks.get(f"{syms[i]} {syms[i + 1]}")) is not None]
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = nxt[i]
            if not syms[i] or j < 0 or ranks.get(f"{syms[i]} {syms[j]}") != r:
                continue  # stale: one side merged or grew since this pair was queued
            syms[i] += syms[j]
            syms[j] = ""
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            for a, b in ((prv[i], i), (i, nxt[i])):
                if a >= 0 and b >= 0 and (r2 := ranks.get(f"{syms[a]} {syms[b]}")) is not None:
                    heapq.heappush(heap, (r2, a))
        return [s for s in syms if s]

    def _ids_of(self, syms: list[str]) -> tuple[int, ...]:
        get, out = self._tok2id.get, []
        for s in syms:
            i = get(s)
            if i is not None:
                out.append(i)
            else:  # not in the vocabulary (only with inconsistent merges): its bytes one by one, as llama.cpp
                out.extend(b for c in s if (b := get(c)) is not None)
        return tuple(out)

    # ---- decode ----
    def token_bytes(self, id: int) -> bytes:
        """The bytes token `id` contributes to decoded text."""
        if type(id) is not int or not 0 <= id < self.n_vocab:
            self._check_id(id)
            id = int(id)
        b = self._bytes[id]
        if b is None:
            b = self._bytes[id] = self._piece(id)
        return b

    def _piece(self, id: int) -> bytes:
        t, typ = self._tokens[id], int(self._types[id])
        if typ in (_CONTROL, _USER, _UNKNOWN):
            return t.encode("utf-8", "surrogateescape")
        if typ != _NORMAL:
            return b""
        try:
            return bytes(_U2B[c] for c in t)
        except KeyError:  # not a byte-level character: keep its UTF-8 (llama.cpp writes [UNK_BYTE_..])
            return b"".join(bytes([_U2B[c]]) if c in _U2B else c.encode("utf-8", "surrogateescape") for c in t)

    def _check_id(self, id) -> None:
        if not isinstance(id, (int, np.integer)) or isinstance(id, bool) or not 0 <= id < self.n_vocab:
            raise StreamerError(f"token id {id!r} is out of range (vocabulary has {self.n_vocab} tokens)")

    def decode(self, ids) -> str:
        """Text of the ids; special tokens render as their text, invalid UTF-8 as U+FFFD."""
        tb = self.token_bytes
        return b"".join([tb(i) for i in ids]).decode("utf-8", "replace")

    def token_id(self, text: str) -> int | None:
        """Exact vocabulary lookup of a token's GGUF text, e.g. "<|im_end|>" (byte-level form for normal tokens)."""
        return self._tok2id.get(text)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Feed ids one at a time; never returns part of a UTF-8 character. flush() ends the stream."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(id))

    def flush(self) -> str:
        """The held tail (an incomplete character becomes U+FFFD); the decoder is then ready for a new stream."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
