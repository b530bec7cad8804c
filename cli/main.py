"""Entry point: registers the commands on the app. Heavy imports live inside the commands, so --help is instant."""

from __future__ import annotations

from cli.app import app
from cli.bench_cmd import bench, profile
from cli.demo_cmd import demo
from cli.info_cmd import inspect
from cli.profiles_cmd import profiles
from cli.run_cmd import chat, run
from cli.synth_cmd import synth
from cli.tokenize_cmd import tokenize
from cli.warmup_cmd import warmup

for command in (run, chat, bench, profile, inspect, tokenize, synth, demo, warmup, profiles):
    app.command()(command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
