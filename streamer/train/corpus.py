"""The training corpus: the CPython standard library source of the running interpreter (real human-written code
and docstrings, present offline on every machine). The file list is sorted, so it is deterministic for one
Python version; the held-out split is by module (a hash of the relative path), so training never sees any of a
held-out module. The evaluation text is committed (tests/data/heldout_stdlib.py.txt) because other machines may
run another Python version."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 20  # one module in 20 is held out
HELDOUT_MAX_BYTES = 200_000  # the committed evaluation text
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib .py file outside the test suites, sorted by path."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if SKIP_PARTS.intersection(rel.split("/")[:-1]) or p.name.startswith("test_"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append((rel, text))
    return out


def split(files: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """(training documents, held-out (path, text) pairs)."""
    train = [t for rel, t in files if not is_heldout(rel)]
    held = [(rel, t) for rel, t in files if is_heldout(rel)]
    return train, held


def heldout_text(held: list[tuple[str, str]], max_bytes: int = HELDOUT_MAX_BYTES) -> str:
    """Whole held-out modules (codec tables skipped), in path order, until max_bytes; each introduced by a
    '# file:' comment line."""
    parts, size = [], 0
    for rel, text in held:
        if rel.startswith("encodings/"):  # codec tables: repetitive data, not prose or code
            continue
        piece = f"# file: Lib/{rel}\n{text}\n"
        if size + len(piece.encode()) > max_bytes:
            continue
        parts.append(piece)
        size += len(piece.encode())
    return "".join(parts)
