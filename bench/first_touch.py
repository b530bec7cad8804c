#!/usr/bin/env python
"""What the first touch of fresh anonymous memory costs here, GiB by GiB: MADV_POPULATE_WRITE over a new
private mapping in 4 KiB pages (as the expert arena is mapped), 2 MiB at a time, from one thread or several
(each its own interleaved share of the chunks).

    python bench/first_touch.py [--gib 8] [--wait 30] [--threads 1]

--wait: seconds to sit still first, so memory freed before is handed back to the host where the VM does that
(virtio-balloon free page reporting); its first touch is then the host's to back again. Prints GiB/s per GiB:
on a VM that reports free pages the first few GiB (still backed) come fast and the rest at the host's pace.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--wait", type=float, default=30)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    time.sleep(a.wait)
    m = mmap.mmap(-1, a.gib * 2**30, flags=mmap.MAP_PRIVATE)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    chunk, per_gib = 2 * 2**20, 512
    done = [0] * a.threads  # chunks each thread has populated
    errors: list[int] = []

    def work(k: int) -> None:
        for i in range(k, a.gib * per_gib, a.threads):
            if libc.madvise(base + i * chunk, chunk, MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())
                return
            done[k] += 1

    threads = [threading.Thread(target=work, args=(k,)) for k in range(a.threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    marks, seen = [], 0
    while seen < a.gib and not errors:  # the time each further GiB was done, all threads together
        time.sleep(0.005)
        while sum(done) >= (seen + 1) * per_gib:
            seen += 1
            marks.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"madvise: errno {errors[0]}")
    print(
        f"{a.threads} thread(s), GiB/s per GiB:", " ".join(f"{1 / (b - a):.2f}" for a, b in zip([0.0] + marks, marks))
    )


if __name__ == "__main__":
    main()
