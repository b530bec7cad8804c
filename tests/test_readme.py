"""The README documents every command and every flag the CLI has (so neither can drift from the other), and
its opening commands are the ones CI runs."""

import re
from pathlib import Path

import typer

from streamer.cli.main import app

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_command_and_flag_is_in_the_readme():
    missing = []
    for name, cmd in typer.main.get_command(app).commands.items():
        if f"stream-run {name}" not in README:
            missing.append(f"command {name}")
        for p in cmd.params:
            if p.param_type_name != "option" or p.name == "help":
                continue
            for opt in p.opts + p.secondary_opts:
                if opt.startswith("--") and not re.search(re.escape(opt) + r"(?![\w-])", README):
                    missing.append(f"{name} {opt}")
    assert not missing, missing


def test_readme_opens_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert block[0] == "pip install . && stream-run demo"
    assert block[1].startswith("pip install '.[test]'") and "&& python -m pytest -q" in block[1]
