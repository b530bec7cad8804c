"""stream-run: Qwen3 / Qwen3-MoE GGUF runner that streams experts from disk under a RAM budget."""

from streamer.errors import StreamerError

__all__ = ["StreamerError"]
