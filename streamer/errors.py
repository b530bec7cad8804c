"""The one exception type for user errors: the CLI prints its message on one line and exits 2."""


class StreamerError(Exception):
    """Bad input (file, tensor, type, value, budget). The message names the bad thing."""


class ModelFileChanged(StreamerError):
    """The model file was truncated or rewritten while in use: the weights mapped from it are no longer valid."""
