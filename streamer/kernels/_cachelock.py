"""numba's on-disk cache, safe when several processes compile at once (numba/numba#10128, open).

numba saves a compiled version by reading the function's index, taking the first data-file number the index does not
use, and writing the index and then the data file. Two processes compiling different signatures of one kernel at once
(two `stream-run` commands on a fresh install, two pytest-xdist workers) can both take number 1, and every later run
then loads the other's machine code for the signature (found by reading numba's code, not reproduced).

install() makes each save hold an exclusive flock on one lock file in the cache directory and each load a shared one,
so a save is seen whole or not at all. Where the lock file cannot be opened (a read-only cache directory, where numba
cannot save either) numba runs as it would without this."""

import contextlib
import fcntl
import os

from numba.core import caching

LOCK_NAME = "stream-run-cache.lock"


@contextlib.contextmanager
def locked(cache_path: str, exclusive: bool):
    """Hold the cache directory's lock: exclusive to save, shared to load."""
    try:
        fd = os.open(os.path.join(cache_path, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def install() -> None:
    """Wrap numba's index-and-data save and load in the lock (once per process)."""
    cls = caching.IndexDataCacheFile
    if getattr(cls, "_stream_run_locked", False):
        return
    save, load = cls.save, cls.load

    def locked_save(self, key, data):
        with locked(self._cache_path, exclusive=True):
            return save(self, key, data)

    def locked_load(self, key):
        with locked(self._cache_path, exclusive=False):
            return load(self, key)

    cls.save, cls.load, cls._stream_run_locked = locked_save, locked_load, True
