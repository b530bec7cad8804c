"""A GGUF file's tensors as the kernels' weight matrices (zero-copy views of the mapping)."""

from __future__ import annotations

from streamer.gguf_file import GGUFFile
from streamer.kernels import QMatrix


def qmatrix(gf: GGUFFile, name: str, expert: int | None = None) -> QMatrix:
    """A weight as a zero-copy QMatrix; for a 3-D expert stack, the slab of one expert."""
    t = gf.tensors[name]
    if expert is None:
        return QMatrix(gf.view(name), t.qtype, t.shape[-1], name)
    return QMatrix(gf.view(name)[expert], t.qtype, t.shape[-1], f"{name}[{expert}]")
