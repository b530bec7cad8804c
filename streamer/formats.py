"""The weight formats stream-run reads, in one table keyed by gguf's GGMLQuantizationType: the kernel family
that reads each, the code that family's kernels branch on (named here, never a bare number) and how matvec
groups the activations. config.py checks files against it without importing numba, kernels/dispatch.py binds
the kernels from it, and the tests enumerate it."""

from __future__ import annotations

from typing import NamedTuple

from gguf.constants import GGMLQuantizationType as T

# Format codes, per kernel family (numba folds these module-level ints into the kernels as constants).
F32 = 0  # floats.f32_*: ignore their code
F16, BF16 = 0, 1  # floats.half_*: which widening
Q8_0, Q4_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 4  # blocks.*; from Q4_K up, 256-element super-blocks
SUPER_BLOCKS = Q4_K


class Format(NamedTuple):
    family: str  # "f32", "half" or "block": the kernel set that reads it
    code: int  # the format code those kernels take first
    act_group: int  # matvec quantizes x to int16 per this many elements (0: x used as f32)


FORMATS: dict[T, Format] = {
    T.F32: Format("f32", F32, 0),
    T.F16: Format("half", F16, 0),
    T.BF16: Format("half", BF16, 0),
    T.Q8_0: Format("block", Q8_0, 32),
    T.Q4_0: Format("block", Q4_0, 32),
    T.Q4_K: Format("block", Q4_K, 256),
    T.Q5_K: Format("block", Q5_K, 256),
    T.Q6_K: Format("block", Q6_K, 256),
}
NAMES = ", ".join(t.name for t in FORMATS)
BLOCK_CODES = {t: f.code for t, f in FORMATS.items() if f.family == "block"}  # also the multi-expert kernels'
