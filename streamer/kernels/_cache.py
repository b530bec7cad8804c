"""Drop this package's numba cache when any kernel source changed.

numba keys a cached function on its own file's timestamp only, so an edit to simd.py, _bits.py,
gemm.py or activations.py would otherwise keep serving stale machine code for the kernels in
other files that inline them (an install or upgrade rewrites every file, so only in-place edits can
do that). `stream-run warmup` and the test session call this before any kernel is loaded; importing
the kernels deletes nothing. Best effort: an unwritable cache directory is left alone.
"""
import hashlib
from pathlib import Path


def drop_stale_numba_cache() -> None:
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))).hexdigest()[:16]
    cache = here / "__pycache__"
    stamp = cache / "kernels-source.sha"
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        for f in cache.glob("*.nb[ic]"):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass
