"""First run as a new user: runtime profiles (budget_fraction, precedence, `stream-run profiles`),
`stream-run warmup` (compiles what a model run later uses, and nothing is left to compile), and a `--help`
that never imports numba."""

import json
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streamer import budget
from streamer.cli.main import app
from streamer.errors import StreamerError
from streamer.options import StreamOptions, available_presets, describe_preset, load_preset

runner = CliRunner()
GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ten_gib(monkeypatch):
    """Pretend 10 GiB are available (what budget_fraction is a share of)."""
    monkeypatch.setattr(budget, "available_memory", lambda: 10 * GiB)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# ---- profiles ----


def test_new_presets_exist_with_descriptions():
    names = set(available_presets())
    assert {"low-ram", "balanced", "max-speed", "8g", "8g-fast", "16g", "32g"} <= names
    for name in names:
        description, opts = describe_preset(name)
        assert description and "\n" not in description, name
        assert ("ram_budget" in opts) != ("budget_fraction" in opts), name  # exactly one kind of budget
    assert load_preset("balanced")["budget_fraction"] == budget.DEFAULT_FRACTION  # "the defaults written out"
    # a lossy preset says so in the line `stream-run profiles` prints
    for name in names:
        description, opts = describe_preset(name)
        if opts.get("expert_top_p", 1.0) < 1.0:
            assert "APPROXIMATE" in description, name


def test_precedence_flag_over_preset_over_default(ten_gib):
    build = StreamOptions.build
    assert build(None, ram_budget=None, expert_top_p=None, prefetch=None) == StreamOptions()  # the defaults
    assert StreamOptions() == StreamOptions(None, True, 1.0, True, True, "auto", 8, 0.5, None)
    assert build("8g", ram_budget=None).ram_budget == 7 * GiB  # preset over default
    assert build("8g", ram_budget="3G").ram_budget == 3 * GiB  # flag over preset
    assert build("max-speed", expert_top_p=None).expert_top_p == 0.9
    assert build("max-speed", expert_top_p=1.0).expert_top_p == 1.0
    assert build("low-ram", prefetch=False).prefetch is False


def test_budget_fraction_becomes_bytes_of_available_memory(ten_gib):
    assert StreamOptions.build("low-ram", ram_budget=None).ram_budget == 5 * GiB
    assert StreamOptions.build("max-speed").ram_budget == int(0.9 * 10 * GiB)
    assert StreamOptions.build("low-ram", ram_budget="2G").ram_budget == 2 * GiB  # an explicit --ram-budget wins


def test_budget_fraction_and_ram_budget_are_exclusive(tmp_path, ten_gib):
    both = tmp_path / "both.toml"
    both.write_text('ram_budget = "4G"\nbudget_fraction = 0.5\n')
    with pytest.raises(StreamerError, match="ram_budget or budget_fraction, not both"):
        StreamOptions.build(str(both))
    r = invoke("run", tmp_path / "any.gguf", "-p", "x", "--profile", both)  # checked before the model is opened
    assert r.exit_code == 2 and "not both" in r.stderr and "Traceback" not in r.output
    for bad in ("0", "1.5", "-0.2", '"half"'):
        (tmp_path / "f.toml").write_text(f"budget_fraction = {bad}\n")
        with pytest.raises(StreamerError, match="budget_fraction"):
            StreamOptions.build(str(tmp_path / "f.toml"))
    (tmp_path / "d.toml").write_text("description = 3\n")
    with pytest.raises(StreamerError, match="'description' has a bad value"):
        load_preset(str(tmp_path / "d.toml"))


def test_every_builtin_preset_gives_valid_options(ten_gib):
    for name in available_presets():
        opts = StreamOptions.build(name)
        for key, value in load_preset(name).items():
            if key in ("readers", "pin_share", "expert_top_p", "expert_skip", "prefetch"):
                assert getattr(opts, key) == value, (name, key)


def test_profile_budget_on_the_command_line(synth_model, monkeypatch):
    """Through `stream-run run`: the plan's budget is the profile's share of (patched) available memory, and
    --ram-budget beats it."""
    monkeypatch.setattr(budget, "available_memory", lambda: 2 * GiB)
    # the plan counts the process's RSS as in use: here that is the test process with the whole suite's compiled
    # kernels (0.5-0.9 GiB, growing with the suite), so it is pinned to a run's own ~250 MiB
    mem = types.SimpleNamespace(rss=250 * 2**20, shared=0)
    monkeypatch.setattr(
        budget, "psutil", types.SimpleNamespace(Process=lambda: types.SimpleNamespace(memory_info=lambda: mem))
    )
    path = synth_model("tiny-moe", "Q8_0")
    r = invoke("run", path, "-p", "x", "-n", "1", "--profile", "low-ram", "--no-learn")
    assert r.exit_code == 0, r.output
    assert re.search(r"RAM budget 1(\.00)? GiB", r.stderr), r.stderr
    r = invoke("run", path, "-p", "x", "-n", "1", "--profile", "low-ram", "--ram-budget", "900M", "--no-learn")
    assert r.exit_code == 0, r.output
    assert re.search(r"RAM budget 900(\.00)? MiB", r.stderr), r.stderr


def test_profiles_command_lists_every_builtin():
    r = invoke("presets")
    assert r.exit_code == 0, r.output
    # the command's old name still works (the "= N GiB now" and "available now: N GiB" figures follow available
    # memory between calls)
    now = re.compile(r"\(= [0-9.]+ GiB now\)|now: [0-9.]+ GiB")
    assert now.sub("", invoke("profiles").stdout) == now.sub("", r.stdout)
    lines = r.stdout.splitlines()
    for name in available_presets():
        description, opts = describe_preset(name)
        assert any(re.match(rf"\s+{re.escape(name)}\s+{re.escape(description)}$", ln) for ln in lines), name
        for k in opts:
            assert f"{k}=" in r.stdout
    assert "--preset PATH.toml" in r.stdout and "budget_fraction" in r.stdout
    # the defaults it states are StreamOptions' own (it once said readers 4 where the default is 8)
    d = StreamOptions()
    text = " ".join(r.stdout.split())
    for k in ("expert_top_p", "expert_skip", "pin_share", "readers"):
        assert f"{k} {getattr(d, k)}" in text, k


def test_profile_help_names_the_builtins():
    r = invoke("run", "--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    for name in ("low-ram", "balanced", "max-speed"):
        assert name in text


# ---- warmup ----

# Runs in a fresh interpreter, so no kernel compiled by another test counts: the real `stream-run warmup`
# command, then a look at every numba dispatcher in streamer.kernels, then real model runs (prefill and
# decode, dense in every supported type, MoE streamed and resident) that must not compile anything new.
WARMUP_SCRIPT = textwrap.dedent("""
    import importlib, inspect, json, pkgutil, re, sys
    import numpy as np
    from numba.core.registry import CPUDispatcher
    from streamer.cli.main import app

    runs = json.loads(sys.argv[1])
    try:
        app(["warmup", *dict.fromkeys(path for path, _ in runs)])  # the App exits with the command's code
    except SystemExit as e:
        assert not e.code, e.code

    import streamer.kernels as K
    disp, jitable = {}, {}
    for m in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module("streamer.kernels." + m.name)
        for n, v in vars(mod).items():
            if isinstance(v, CPUDispatcher) and v.__module__ == mod.__name__:
                disp[mod.__name__ + "." + n] = v
            elif inspect.isfunction(v) and v.__module__ == mod.__name__:
                jitable[mod.__name__ + "." + n] = v  # incl. register_jitable helpers and @overload bodies
    sigs = lambda: {k: sorted(map(str, d.signatures)) for k, d in disp.items()}
    before = sigs()
    sources = {k: inspect.getsource(d.py_func) for k, d in disp.items()}
    sources.update({k: inspect.getsource(f) for k, f in jitable.items()})
    helpers = [k for k in disp if any(re.search(r"\\b" + k.rsplit(".", 1)[1] + r"\\(", src)
                                      for j, src in sources.items() if j != k)]
    helpers += [k for k, d in disp.items() if d.targetoptions.get("inline") == "always"]  # inlined as IR only

    from streamer.options import StreamOptions
    from streamer.session import open_model
    called = set()  # the dispatchers these runs call directly (warmup.model_kernels), by kernel
    for path, kw in runs:
        s = open_model(path, StreamOptions(learn=False, **kw))
        called |= {d.py_func.__module__ + "." + d.py_func.__name__ for d in s.kernels}
        cache = s.model.new_state()
        s.model.forward(np.arange(1, 7), cache)  # prefill: 6 tokens (matrix-matrix kernels)
        s.model.forward(np.array([7]), cache)    # decode: one token (matvec, multi-expert kernels)
        s.model.forward(np.array([8]), cache)
        s.close()
    print(json.dumps({"before": before, "after": sigs(), "helpers": helpers, "called": sorted(called)}))
""")


@pytest.mark.slow  # an exhaustive case: every ISA / format / kernel compiled cold
def test_warmup_compiles_every_kernel_a_run_uses(synth_model, tmp_path):
    from streamer.kernels.dispatch import SUPPORTED

    # a dense file per kernel family (f32, half, block formats) and the common block formats: each format's
    # kernels are compiled apart (kernels/specialise.py), and all 23 formats' decode blocks cost CI minutes here
    # (test_kernels runs every format's matrix kernels)
    dense = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS")
    runs = [(str(synth_model("tiny", t)), {}) for t in dense]
    moe = synth_model("tiny-moe", "Q4_K")
    runs += [
        (str(moe), {"expert_cache_bytes": 1 << 20}),
        (str(moe), {"stream": False}),
        (str(synth_model("tiny-moe", "Q8_0")), {"expert_cache_bytes": 1 << 20}),
        (str(synth_model("tiny-qwen35moe", "Q8_0")), {"expert_cache_bytes": 1 << 20}),
    ]
    p = subprocess.run(
        [sys.executable, "-c", WARMUP_SCRIPT, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # the command's own report: one line per model (the kernels its run calls), then the total
    for path in dict.fromkeys(path for path, _ in runs):
        name = re.escape(Path(path).name)
        assert re.search(rf"^{name}: \d+ kernels, (compiled \d+|from cache) in [\d.]+ s$", p.stderr, re.M), (
            path,
            p.stderr,
        )
    assert re.search(r"^warmup: \d+ kernels ready .* in [\d.]+ s; numba cache: ", p.stdout, re.M), p.stdout
    got = json.loads(p.stdout.strip().splitlines()[-1])
    before, after, helpers, called = got["before"], got["after"], set(got["helpers"]), set(got["called"])
    # every kernel of the dispatch table has a compiled version after warmup (every table kernel serves one of these)
    for t, k in SUPPORTED.items():
        for f in (k.matvec, k.matmul, k.rows):
            assert before[f"{f.__module__}.{f.__name__}"], (t.name, f.__name__)
    # and so has every dispatcher these runs call, and every other one but helpers that only other kernels call
    # (compiled into them) and kernels no run of these models calls on this CPU (another ISA's integer kernels,
    # the f32 tiles' register block for the other number of vector registers, the f32 expert tiles where an
    # integer kernel serves: a warm-up with models compiles those models' own)
    from streamer.kernels import gemm

    missing = [k for k, v in before.items() if not v and k not in helpers]
    assert not set(missing) & called, missing
    other_block = [n for n in ("gemm_tile_4x4", "gemm_tile_4x3") if getattr(gemm, n) is not gemm.gemm_tile]
    assert set(missing) <= {
        *(f"streamer.kernels.gemm.{n}" for n in other_block),
        "streamer.kernels.grouped.grouped_matmul",
        *(f"streamer.kernels.int8.i8_{kind}_{isa}" for kind in ("matmul", "grouped") for isa in ("vnni", "generic")),
        *(k for k in before if k.startswith("streamer.kernels.lanes.")),
    }, missing
    # real runs afterwards found everything compiled: no new signature anywhere
    grown = {k: (before[k], after[k]) for k in after if after[k] != before[k]}
    assert not grown, grown


# ---- --help without numba ----

HELP_SCRIPT = textwrap.dedent("""
    import runpy, sys, time
    script, cmds = sys.argv[1], sys.argv[2:]
    times = {}
    for cmd in cmds:
        sys.argv = [script] + ([cmd] if cmd else []) + ["--help"]
        t0 = time.perf_counter()
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            assert not e.code, (cmd, e.code)
        times[cmd or "(app)"] = time.perf_counter() - t0
        heavy = [m for m in ("numba", "streamer.kernels", "starlette", "matplotlib") if m in sys.modules]
        assert not heavy, (cmd, heavy)
    print("TIMES", times, file=sys.stderr)
""")


def test_help_of_every_command_through_the_real_script_imports_no_numba():
    import typer.main

    script = Path(sys.executable).parent / "stream-run"
    if not script.exists():
        pytest.skip(f"no console script at {script} (package not installed)")
    names = [c.name for c in typer.main.get_command(app).commands.values()]
    assert {"warmup", "presets", "profiles", "demo", "run"} <= set(names)
    # the real entry point, each subcommand's --help in turn, in one process
    p = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, str(script), "", *names], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("Usage:") == len(names) + 1
    # and one whole process, as a user types it
    p = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "warmup" in p.stdout and "presets" in p.stdout
