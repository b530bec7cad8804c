"""`stream-run tokenize MODEL [FILE] [--text TEXT]`: one token id per line, the parity oracle to compare with
`llama-tokenize` (special tokens resolved, no BOS/EOS added, no Unicode normalisation)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile
from streamer.tokenizer import Tokenizer


def tokenize(
    model: Path = typer.Argument(..., help="GGUF file whose tokenizer.* metadata to use.", show_default=False),
    file: Optional[Path] = typer.Argument(
        None, help="UTF-8 text file to tokenize (or use --text).", show_default=False
    ),
    text: Optional[str] = typer.Option(None, "--text", help="Text to tokenize instead of FILE."),
) -> None:
    """Print the token ids of FILE (or --text), one per line, as llama-tokenize counts them."""
    if (file is None) == (text is None):
        raise StreamerError("give exactly one of FILE or --text")
    if file is not None:
        try:
            raw = file.read_bytes()
        except OSError as e:
            raise StreamerError(f"cannot read {file}: {e.strerror or e}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise StreamerError(
                f"{file} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at offset {e.start})"
            ) from None
    tok = Tokenizer.from_gguf(GGUFFile(model))
    ids = tok.encode_raw(text)
    if ids:
        sys.stdout.write("\n".join(map(str, ids)) + "\n")
