"""Entry point: registers the commands on the app. Heavy imports live inside the commands, so --help is instant."""

from __future__ import annotations

from streamer.cli.app import app
from streamer.cli.bench_cmd import bench, profile
from streamer.cli.demo_cmd import demo
from streamer.cli.info_cmd import inspect
from streamer.cli.perplexity_cmd import perplexity
from streamer.cli.plan_cmd import plan
from streamer.cli.presets_cmd import presets
from streamer.cli.replay_cmd import replay
from streamer.cli.run_cmd import chat, run
from streamer.cli.serve_cmd import serve
from streamer.cli.synth_cmd import synth
from streamer.cli.tokenize_cmd import tokenize
from streamer.cli.warmup_cmd import warmup

for command in (
    run,
    chat,
    perplexity,
    serve,
    bench,
    profile,
    replay,
    plan,
    inspect,
    tokenize,
    synth,
    demo,
    warmup,
    presets,
):
    app.command()(command)
app.command("profiles", hidden=True)(presets)  # the command's name before presets were called presets


def main() -> None:
    app()


if __name__ == "__main__":
    main()
