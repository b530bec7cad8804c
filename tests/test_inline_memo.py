"""numba's IR inliner with each inlined function prepared once per process (kernels/_inline.py): kernels that
inline one helper at several sites, and a helper that itself inlines another, compute what the same Python code
computes, while the helper's untyped passes ran once."""

import numpy as np
from numba import njit
from numba.core import inline_closurecall

from streamer.kernels import _inline  # noqa: F401  (installed by the kernels package)


@njit(inline="always")
def _scaled(x, k):
    y = x * k
    if k > 2:  # a branch on the argument: each site keeps its own value of y
        y += 1.0
    return y


@njit(inline="always")
def _pair(x, k):
    a = _scaled(x, k)
    b = _scaled(x, k + 2)
    return a * 10.0 + b


@njit(cache=False)
def _three_sites(x):
    a = _scaled(x, 1)
    b = _scaled(x, 2)
    c = _scaled(x, 3)
    return a * 100.0 + b * 10.0 + c


@njit(cache=False)
def _nested(x):
    return _pair(x, 1) * 1000.0 + _pair(x, 2)


def _py_scaled(x, k):
    return x * k + (1.0 if k > 2 else 0.0)


def _py_pair(x, k):
    return _py_scaled(x, k) * 10.0 + _py_scaled(x, k + 2)


def test_the_memo_is_installed():
    assert inline_closurecall.InlineWorker._stream_run_memo


def test_a_helper_inlined_at_three_sites_keeps_each_sites_values():
    for x in (1.0, -2.5, 7.0):
        want = _py_scaled(x, 1) * 100.0 + _py_scaled(x, 2) * 10.0 + _py_scaled(x, 3)
        assert _three_sites(x) == want
    # the helper's front end ran once for its three sites (then once more per other caller's flags, if any)
    prepared = [k for k in _inline.MEMO if k[0] is _scaled.py_func]
    assert 1 <= len(prepared) <= 2, prepared


def test_nested_inlining_through_the_memo():
    for x in (1.0, 3.0, np.float64(-0.5)):
        assert _nested(x) == _py_pair(x, 1) * 1000.0 + _py_pair(x, 2)
    assert [k for k in _inline.MEMO if k[0] is _pair.py_func]
