"""cli/early.py: the entry point starts reading a `run`/`chat` model before the CLI is loaded. It is a
hint that must never change what a command does: bad input is still one line and exit 2, a budget the plan
refuses reads nothing up front (or the early reads are stopped), open_model goes on with the early page-in
only when its own budget check asks for the very same ranges, and results are those of the resident model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamer.cli import early
from streamer.options import StreamOptions
from streamer.session import early_plan, open_model

STREAM_RUN = Path(sys.executable).parent / "stream-run"


@pytest.fixture(autouse=True)
def _clean():
    early.stop()
    early._held.clear()
    yield
    early.stop()
    early._held.clear()


@pytest.mark.parametrize(
    "argv, want",
    [
        (["sr", "run", "m.gguf", "-p", "hi"], ("m.gguf", {})),
        (["sr", "chat", "m.gguf", "--ram-budget", "8G", "-c", "64"], ("m.gguf", {"ram_budget": "8G", "n_ctx": "64"})),
        (["sr", "run", "m.gguf", "--ram-budget=2G", "--no-stream"], ("m.gguf", {"ram_budget": "2G", "stream": False})),
        (["sr", "run", "m.gguf", "--profile", "low-ram"], ("m.gguf", {"preset": "low-ram"})),
        (["sr", "bench", "m.gguf"], None),  # another command
        (["sr", "run", "--help"], None),
        (["sr", "run", "m.gguf", "--help"], None),
        (["sr", "run", "m.gguf", "--ram-budget", "1G", "--ram-budget", "2G"], None),  # given twice: unclear
        (["sr", "run", "m.gguf", "--preset", "x", "--profile", "y"], None),
        (["sr", "run", "m.gguf", "--ram-budget"], None),  # no value
        (["sr", "run"], None),
    ],
)
def test_flags(argv, want):
    assert early.flags(argv) == want


def test_started_early_then_adopted_and_logits_unchanged(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    early.start(["stream-run", "run", str(path), "--tokens", "1,2", "--ram-budget", "4G", "--no-learn"])
    assert "pagein" in early._held  # started before any CLI parsing
    p = early._held["pagein"]
    gf, cfg = early.take_file(path)
    assert early.take_file(Path(str(path) + "x")) is None  # another path: not this one
    options = StreamOptions(learn=False, ram_budget=4 * 2**30)
    assert early._held["ranges"] == early_plan(gf, cfg, options, options.ram_budget, None)[0]
    ids = np.array([3, 17, 5, 9])
    with open_model(gf, options, started_pagein=early.take_pagein(gf)) as s:
        assert s.pagein is p  # the same page-in, gone on with the rest of what the budget keeps
        got = s.model.forward(ids, s.model.new_state(), all_logits=True)
    with open_model(path, StreamOptions(learn=False, stream=False)) as s:
        want = s.model.forward(ids, s.model.new_state(), all_logits=True)
    assert np.array_equal(got, want)


def test_refused_budget_reads_nothing_early_and_other_ranges_stop_the_hint(synth_model):
    from streamer.errors import StreamerError

    path = synth_model("tiny-moe", "Q8_0")
    early.start(["stream-run", "run", str(path), "--ram-budget", "64M"])  # the plan refuses it
    assert "gf" in early._held and "pagein" not in early._held
    # the margin for the imports still to come: a budget that passes only without it starts nothing
    gf, cfg = early.take_file(path)
    assert early_plan(gf, cfg, StreamOptions(), 4 * 2**30, None, rss_margin=2**40)[0] == []
    # the entry point guessed a budget open_model's own check disagrees with: the early reads stop
    early.start(["stream-run", "run", str(path), "--ram-budget", "4G"])
    p = early._held["pagein"]
    gf, _ = early.take_file(path)
    with pytest.raises(StreamerError, match="too small"):
        open_model(gf, StreamOptions(learn=False, ram_budget=64 * 2**20), started_pagein=early.take_pagein(gf))
    assert p._stop.is_set() and p.finished and "pagein" not in early._held


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tokens", "abc"], "error: --tokens must be comma-separated integers"),
        (["--tokens", "1", "--ram-budget", "0"], "error: --ram-budget must be positive"),
        (["--tokens", "1", "--bogus"], "error: No such option: --bogus"),
        (["--tokens", "99999999"], "error: "),
    ],
)
def test_bad_input_is_still_one_line_and_exit_2(synth_model, tmp_path, extra, message):
    if not STREAM_RUN.exists():
        pytest.skip(f"no console script at {STREAM_RUN}")
    path = synth_model("tiny-moe", "Q8_0")
    env = dict(os.environ, STREAM_RUN_CACHE=str(tmp_path))
    p = subprocess.run(
        [str(STREAM_RUN), "run", str(path), *extra], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 2 and p.stderr.startswith(message), p.stderr
    assert len(p.stderr.splitlines()) == 1 and not p.stdout


@pytest.mark.parametrize("name", sorted(__import__("streamer.cli.main", fromlist=["COMMANDS"]).COMMANDS))
@pytest.mark.parametrize("args", [["--help"], ["--no-such-flag"]])
def test_a_one_command_app_helps_and_fails_as_the_whole_app(name, args, capsys):
    """main() builds only the command it is asked for: its help and its usage errors are the same."""
    from streamer.cli.main import _build_app, app

    out = []
    for a in (app, _build_app(name)):
        with pytest.raises(SystemExit) as e:
            a([name, *args])
        cap = capsys.readouterr()
        out.append((e.value.code, cap.out, cap.err))
    assert out[0] == out[1] and out[0][0] == (0 if args == ["--help"] else 2)
    assert (name in out[0][1]) if args == ["--help"] else out[0][2].startswith("error: No such option")


def test_ctrl_c_while_starting_is_exit_130_without_a_traceback(monkeypatch, capsys):
    from streamer.cli import main as entry

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(early, "start", interrupted)
    monkeypatch.setattr(sys, "argv", ["stream-run", "run", "model.gguf"])
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_pages_the_early_page_in_mapped_are_not_the_process_s_own(synth_model, monkeypatch):
    """open_model's check runs with the early page-in's pages mapped (RSS as file pages): as split_budget, it
    leaves them out of the process's own share, else a budget that fits would look too small."""
    from collections import namedtuple

    import psutil

    from streamer.budget import MARGIN_DIV, MARGIN_FIXED, margin_bytes, scratch_bytes
    from streamer.config import ModelConfig
    from streamer.experts.store import ExpertLayout
    from streamer.gguf_file import GGUFFile
    from streamer.mapping import PAGE

    path = synth_model("tiny-moe", "Q8_0")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    layout = ExpertLayout(gf, cfg)
    nonexpert = sum(t.nbytes for t in gf.tensors.values() if "_exps." not in t.name)
    need = nonexpert + cfg.kv_bytes_per_token * cfg.context(None) + scratch_bytes(cfg)
    need += cfg.n_expert_used * layout.slot_bytes
    own, mapped = 100 * 2**20, 2**30  # (a page-in of a bigger model's weights: 1 GiB mapped)
    budget = -(-(own + need + MARGIN_FIXED) * MARGIN_DIV // (MARGIN_DIV - 1)) + PAGE  # fits own, not own + mapped
    assert budget - margin_bytes(budget) >= own + need
    mem = namedtuple("mem", "rss shared")(own + mapped, mapped)
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: mem)
    options = StreamOptions(learn=False, ram_budget=budget)
    assert (
        early_plan(gf, cfg, options, options.ram_budget, None)[0] == []
    )  # the mapped pages counted as the process's own
    assert early_plan(gf, cfg, options, options.ram_budget, None, mapped=mapped)[0] != []
