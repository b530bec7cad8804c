"""Drop this package's numba cache when any kernel source changed.

numba keys a cached function on its own file's contents only, so an edit to simd.py, blocks.py, _bits.py,
gemm.py or activations.py would otherwise keep serving stale machine code for the kernels in other files
that inline them (an install or upgrade rewrites every file, so only in-place edits can do that). Both
places numba may keep the cache are checked: __pycache__ beside the sources, and the directory under
NUMBA_CACHE_DIR when that is set. `stream-run warmup` and the test suite's conftest call this before any kernel is
loaded; importing the kernels deletes nothing. Best effort: an unwritable cache directory is left alone.
"""

import hashlib
from pathlib import Path

from numba.core import config
from numba.core.caching import UserProvidedCacheLocator


def _cache_dirs(here: Path) -> list[Path]:
    dirs = [here / "__pycache__"]
    if config.CACHE_DIR:  # numba's own rule for where NUMBA_CACHE_DIR keeps this directory's kernels
        dirs.append(Path(config.CACHE_DIR) / UserProvidedCacheLocator.get_suitable_cache_subpath(str(here / "x.py")))
    return dirs


def drop_stale_numba_cache() -> None:
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))).hexdigest()[:16]
    for cache in _cache_dirs(here):
        stamp = cache / "kernels-source.sha"
        try:
            if stamp.read_text() == digest:
                continue
        except OSError:
            pass
        try:
            for f in cache.glob("*.nb[ic]"):
                f.unlink(missing_ok=True)
            cache.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest)
        except OSError:
            pass
