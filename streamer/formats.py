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
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 = 0, 1, 2, 3, 4, 5, 6  # blocks.*: 32-element blocks
Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS = 7, 8, 9, 10, 11, 12  # from Q4_K up, 256-element super-blocks
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = 13, 14, 15, 16, 17, 18, 19
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
    T.Q4_1: Format("block", Q4_1, 32),
    T.Q5_0: Format("block", Q5_0, 32),
    T.Q5_1: Format("block", Q5_1, 32),
    T.IQ4_NL: Format("block", IQ4_NL, 32),
    T.MXFP4: Format("block", MXFP4, 32),
    T.Q4_K: Format("block", Q4_K, 256),
    T.Q5_K: Format("block", Q5_K, 256),
    T.Q6_K: Format("block", Q6_K, 256),
    T.Q2_K: Format("block", Q2_K, 256),
    T.Q3_K: Format("block", Q3_K, 256),
    T.IQ4_XS: Format("block", IQ4_XS, 256),
    T.IQ2_XXS: Format("block", IQ2_XXS, 256),
    T.IQ2_XS: Format("block", IQ2_XS, 256),
    T.IQ2_S: Format("block", IQ2_S, 256),
    T.IQ3_XXS: Format("block", IQ3_XXS, 256),
    T.IQ3_S: Format("block", IQ3_S, 256),
    T.IQ1_S: Format("block", IQ1_S, 256),
    T.IQ1_M: Format("block", IQ1_M, 256),
}
NAMES = ", ".join(t.name for t in FORMATS)
BLOCK_CODES = {t: f.code for t, f in FORMATS.items() if f.family == "block"}  # also the multi-expert kernels'
