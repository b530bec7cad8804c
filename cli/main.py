"""Entry point: registers the commands on the app. Heavy imports live inside the commands, so --help is instant."""

from __future__ import annotations

from cli.app import app
from cli.info_cmd import inspect
from cli.run_cmd import chat, run
from cli.synth_cmd import synth

app.command()(run)
app.command()(chat)
app.command()(inspect)
app.command()(synth)

try:  # the tokenizer command lands with the tokenizer
    from cli.tokenize_cmd import tokenize
    app.command()(tokenize)
except ImportError:
    pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
