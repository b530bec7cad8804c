"""numba kernels for the GGML weight formats in Qwen3 GGUFs (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K).

QMatrix wraps one 2-D weight view and exposes matvec (decode), matmul (prefill) and rows
(embedding gather); SUPPORTED is the dispatch table keyed by GGMLQuantizationType (streamer.formats).
"""
from .dispatch import SUPPORTED, QMatrix, set_threads

__all__ = ["QMatrix", "SUPPORTED", "set_threads"]
