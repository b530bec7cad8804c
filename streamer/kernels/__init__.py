"""numba kernels for the GGML weight formats in Qwen3 GGUFs (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ1_S, IQ1_M).

QMatrix wraps one 2-D weight view and exposes matvec (decode), matmul (prefill) and rows
(embedding gather); SUPPORTED is the dispatch table keyed by GGMLQuantizationType (streamer.formats).
"""

from .dispatch import SUPPORTED, QMatrix, set_threads

__all__ = ["QMatrix", "SUPPORTED", "set_threads"]
