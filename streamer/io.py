"""Small file helpers: read user text with clear errors, write outputs atomically (never in place),
parse sizes such as 8G."""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np

from streamer.errors import StreamerError


def read_text(path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise StreamerError(f"no such file: {path}") from None
    except UnicodeDecodeError as e:
        raise StreamerError(f"{path} is not valid UTF-8 (byte {e.start})") from None


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, write) -> None:
    """Write via a temp file in the same directory, then rename: a crash never leaves a half-written file.
    The result gets the mode a plain open() would give (mkstemp's is 0600); a symlink is written through."""
    path = os.path.realpath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save_npy(path, arr: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, arr))


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5G', '123456' -> bytes (binary units, as the RAM is counted)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise StreamerError(f"cannot read size {text!r} (examples: 8G, 512M, 1.5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def human(n: float) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
