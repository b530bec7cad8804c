"""Text -> pieces before BPE: special-token partition, then the qwen2 or qwen35 split regex.

The qwen2 pattern from tokenizer.json needs \\p{L} / \\p{N}, which the standard `re` lacks. The letter and
number classes are therefore built once from `unicodedata` as explicit ranges, and `\\s` is spelled out as
Unicode White_Space (what llama.cpp's unicode-data table and oniguruma use; `re`'s own `\\s` would add
U+001C..U+001F). llama.cpp runs this pattern with std::regex over a "collapsed" text in which every
non-ASCII code point stands for its class (letter / number / whitespace / other); a backtracking `re` over
the same classes makes the same leftmost-first choices, so the pieces are the same.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, the form llama.cpp runs (ASCII-only case folding):
# (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
#   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2")  # names llama.cpp maps to QWEN2
# LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5/3.6 files): QWEN2's pattern with combining marks kept in letter runs
# and out of punctuation runs: [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+ and  ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*
QWEN35_PRE = ("qwen35",)

# Unicode White_Space (PropList.txt), as in llama.cpp's gen-unicode-data.py.
WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Python's `re` tests BMP class members with a bitmap but walks astral ranges one by one, which made the
# split 8x slower. So the classes hold BMP code points only, and astral characters (emoji, CJK Ext. B ...)
# are first replaced one-for-one by a BMP stand-in of the same class; spans are the same in both strings.
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_STAND_IN = {"L": "\u00aa", "N": "\u00b2", "M": "\u0300"}  # ª (Lo), ² (No), U+0300 (Mn); else ¦ (So)
_OTHER = "\u00a6"

# llama.cpp's unicode-data.cpp is generated from Unicode 15.1; Python 3.11's unicodedata is 14.0. These are
# the code points that are L, N or M in 15.1 but unassigned in 14.0 (the letters and numbers computed with
# Python 3.13's 15.1 data; the marks, which only qwen35's split sets apart, checked against llama.cpp's ids in
# tests/tok_llama_golden.json). Two marks are in the BMP (unicode_classes adds them); the rest are astral, for
# the stand-in lookup. Characters added in Unicode 16 are unassigned for llama.cpp (HF tokenizers' oniguruma
# already knows them, so HF and llama.cpp differ there).
UNICODE_15_1_NEW = (
    (0x0CF3, 0x0CF3, "M"),
    (0x0ECE, 0x0ECE, "M"),
    (0x10EFD, 0x10EFF, "M"),
    (0x1123F, 0x11240, "L"),
    (0x11241, 0x11241, "M"),
    (0x11F00, 0x11F01, "M"),
    (0x11F02, 0x11F02, "L"),
    (0x11F03, 0x11F03, "M"),
    (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"),
    (0x11F34, 0x11F3A, "M"),
    (0x11F3E, 0x11F42, "M"),
    (0x11F50, 0x11F59, "N"),
    (0x1342F, 0x1342F, "L"),
    (0x13440, 0x13440, "M"),
    (0x13441, 0x13446, "L"),
    (0x13447, 0x13455, "M"),
    (0x1B132, 0x1B132, "L"),
    (0x1B155, 0x1B155, "L"),
    (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"),
    (0x1E030, 0x1E06D, "L"),
    (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"),
    (0x1E4EC, 0x1E4EF, "M"),
    (0x1E4F0, 0x1E4F9, "N"),
    (0x2B739, 0x2B739, "L"),
    (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)


def _ranges(cps: list[int]) -> str:
    """Sorted code points -> a regex class body of \\U escapes (safe inside [...] whatever the character)."""
    out, i = [], 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(f"\\U{cps[i]:08x}" if i == j else f"\\U{cps[i]:08x}-\\U{cps[j]:08x}")
        i = j + 1
    return "".join(out)


@lru_cache(maxsize=1)
def unicode_classes() -> tuple[str, str, str, str]:
    """(letters, numbers, whitespace, marks) of the BMP as regex class bodies, from this Python's unicodedata
    and UNICODE_15_1_NEW's BMP entries."""
    cat = unicodedata.category
    classes: dict[str, list[int]] = {"L": [], "N": [], "M": []}
    for cp in range(0x10000):
        c = cat(chr(cp))[0]
        if c in classes:
            classes[c].append(cp)
    for lo, hi, c in UNICODE_15_1_NEW:
        if hi < 0x10000:
            classes[c] += range(lo, hi + 1)
    letters, numbers, marks = (_ranges(sorted(classes[c])) for c in "LNM")
    return letters, numbers, _ranges(sorted(WHITESPACE)), marks


@lru_cache(maxsize=2)
def split_regex(marks: bool = False) -> re.Pattern:
    """The qwen2 pattern; marks: the qwen35 one (combining marks join letter runs)."""
    L, N, S, M = unicode_classes()
    LM = L + M if marks else L
    pattern = (
        r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
        rf"|[^\r\n{L}{N}]?[{LM}]+"
        rf"|[{N}]"
        rf"| ?[^{S}{LM}{N}]+[\r\n]*"
        rf"|[{S}]*[\r\n]+"
        rf"|[{S}]+(?![^{S}])"
        rf"|[{S}]+"
    )
    return re.compile(pattern)


@lru_cache(maxsize=4096)
def _stand_in(ch: str) -> str:
    cat = unicodedata.category(ch)
    if cat == "Cn":
        cp = ord(ch)
        cat = next((c for lo, hi, c in UNICODE_15_1_NEW if lo <= cp <= hi), cat)
    return _STAND_IN.get(cat[0], _OTHER)


def split_words(text: str, marks: bool = False) -> list[str]:
    """The qwen2 pre-tokenizer (marks: qwen35's): every character lands in exactly one piece (the last three
    alternatives cover whitespace, the fourth everything that is not a letter, number or space)."""
    pat = split_regex(marks)
    if not _ASTRAL.search(text):
        return pat.findall(text)
    collapsed = _ASTRAL.sub(lambda m: _stand_in(m.group()), text)
    return [text[m.start() : m.end()] for m in pat.finditer(collapsed)]


def partition_specials(text: str, specials: list[tuple[str, int]]) -> list[str | int]:
    """Split `text` on special-token texts the way llama.cpp's tokenizer_st_partition does.

    `specials` is (text, id) sorted longest first. Each token in turn claims all its non-overlapping
    left-to-right occurrences in the fragments still raw; the result alternates str fragments (non-empty)
    and int ids. Longest-first is what makes "<|im_start|>" win over any shorter token inside it.
    """
    frags: list[str | int] = [text] if text else []
    for tok_text, tok_id in specials:
        if tok_text not in text:  # fragments are substrings of text: one C-level scan rules most tokens out
            continue
        out: list[str | int] = []
        for f in frags:
            if isinstance(f, int) or tok_text not in f:
                out.append(f)
                continue
            parts = f.split(tok_text)
            for k, part in enumerate(parts):
                if k:
                    out.append(tok_id)
                if part:
                    out.append(part)
        frags = out
    return frags
