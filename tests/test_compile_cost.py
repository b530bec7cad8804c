"""What a first run compiles beyond the kernels themselves: numba compiles the library code a kernel's Python
calls (array assignment, its error messages) once per process, at a cost of its own. A cold cache, in a fresh
interpreter, so that nothing is loaded from disk or compiled already."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json
import numpy as np
from numba.core import event
from gguf import GGMLQuantizationType as T
from streamer.formats import Q8_0
from streamer.kernels import floats, int8
from streamer.kernels.dispatch import SUPPORTED

compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__module__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
act = int8.quantize(Q8_0, np.ones((2, 64), np.float32), 2)
g = int8.gather(act, np.array([1, -1, 0, 0], np.int64))
w = np.arange(12, dtype=np.float32).reshape(3, 4)
w.flags.writeable = False
rows = np.empty((2, 4), np.float32)
floats.f32_rows(SUPPORTED[T.F32].fmt, w, np.array([2, 0], np.int64), rows)
ok = (g.xq[0] == act.xq[1]).all() and (g.xq[1] == 0).all() and (g.dx[2] == act.dx[0]).all()
ok = ok and (rows == w[[2, 0]]).all()
print(json.dumps({"modules": sorted(set(compiled)), "ok": bool(ok)}))
"""


def test_row_copies_compile_no_string_code(tmp_path):
    """int8.gather_act and floats.f32_rows copy rows element by element: numba's row assignment (a[i] = b[j])
    compiles its shape check's error message, numba's string code, 3.5 s of a first run (2026-12-06)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ok"]
    assert "numba.cpython.unicode" not in got["modules"], got["modules"]
    assert "streamer.kernels.int8" in got["modules"] and "streamer.kernels.floats" in got["modules"]
