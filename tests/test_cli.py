"""The stream-run command line, end to end on tiny synthetic models: outputs, the chat's KV reuse, and one
clear line with exit code 2 for every kind of bad input."""

import json
import re

import numpy as np
from typer.testing import CliRunner

from streamer.cli.main import app
from streamer.session import open_model

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def user_error(result, pattern):
    """Exit code 2 and one 'error: ...' line matching pattern, last on stderr (after any progress lines such as
    the budget plan), no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in result.output


def test_help_lists_commands():
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("run", "chat", "bench", "profile", "inspect", "tokenize", "synth", "demo", "warmup", "presets"):
        assert cmd in r.stdout


def test_run_streams_a_greedy_completion(synth_model):
    path = synth_model("tiny", "Q8_0")
    r = invoke("run", path, "-p", "hello world", "-n", "6")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("hello world")
    assert re.search(r"prompt: \d+ tok .* generation: \d+ tok .*tok/s", r.stderr)
    again = invoke("run", path, "-p", "hello world", "-n", "6")
    assert again.stdout == r.stdout  # greedy is deterministic


def test_run_sampling_is_seeded(synth_model):
    path = synth_model("tiny", "Q8_0")
    a = invoke("run", path, "-p", "abc", "-n", "8", "--temp", "1.0", "--seed", "5")
    b = invoke("run", path, "-p", "abc", "-n", "8", "--temp", "1.0", "--seed", "5")
    assert a.exit_code == 0 and a.stdout == b.stdout and "seed 5" in a.stderr


def test_logits_out_matches_the_model(synth_model, tmp_path):
    path = synth_model("tiny", "Q8_0")
    out = tmp_path / "logits.npy"
    r = invoke("run", path, "--tokens", "1,2,3,40,5", "--logits-out", out)
    assert r.exit_code == 0, r.output
    got = np.load(out)
    s = open_model(path)
    want = s.model.forward(np.array([1, 2, 3, 40, 5]), s.model.new_state(), all_logits=True)
    assert got.dtype == np.float32 and got.shape == (5, s.cfg.n_vocab)
    assert np.array_equal(got, want)


def test_inspect_text_and_json(synth_model):
    path = synth_model("tiny-moe", "Q4_K")
    r = invoke("inspect", path)
    assert r.exit_code == 0 and "qwen3moe" in r.stdout and "16 per layer, 4 used" in r.stdout
    info = json.loads(invoke("inspect", path, "--json").stdout)
    assert info["expert_bytes"] + info["resident_bytes"] == sum(v["bytes"] for v in info["tensors_by_type"].values())
    assert info["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 2  # K and V, 4 layers, 2 kv heads, head_dim 64, f16


def test_bench_json_is_one_line_with_the_keys(synth_model):
    r = invoke("bench", synth_model("tiny-moe", "Q8_0"), "--pp", "8", "--tg", "4", "--json")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    for k in (
        "pp_tok_s",
        "tg_tok_s",
        "disk_read_bytes",
        "expert_hit_rate",
        "read_bytes_per_token",
        "peak_rss_bytes",
        "prefetch_recall",
        "tokens",
    ):
        assert k in d
    assert len(d["tokens"]) == 4 and d["pp_tok_s"] > 0 and d["tg_tok_s"] > 0
    # the 3 decode steps' spread: ordered; with 3 steps min, median and max are the steps themselves, and they lie
    # inside the decode's wall time that tg_tok_s is taken from (3 steps in 3 / tg_tok_s seconds). How much the
    # loop spends outside its steps depends on the machine's load, so only this side is exact.
    q = d["tg_step_ms"]
    assert 0 < q["min"] <= q["median"] <= q["p90"] <= q["max"]
    assert q["min"] + q["median"] + q["max"] <= 3e3 / d["tg_tok_s"] * (1 + 1e-9)


def test_bench_text_shows_the_step_spread_and_one_token_has_none(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    r = invoke("bench", path, "--pp", "4", "--tg", "3")
    assert r.exit_code == 0, r.output
    assert re.search(r"steps [\d.]+ / [\d.]+ / [\d.]+ / [\d.]+ ms \(min / median / p90 / max\)", r.stdout), r.stdout
    r = invoke("bench", path, "--pp", "4", "--tg", "1", "--json")  # no decode step after the prefill's token
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tg_step_ms"] is None
    r = invoke("bench", path, "--pp", "4", "--tg", "1")
    assert r.exit_code == 0 and "decode   1 tokens" in r.stdout and "steps" not in r.stdout, r.output


def test_profile_table_and_json(synth_model, tmp_path):
    out = tmp_path / "traffic.json"
    r = invoke("profile", synth_model("tiny-moe", "Q8_0"), "-p", "one two three", "-n", "5", "--json-out", out)
    assert r.exit_code == 0, r.output
    assert "layer" in r.stdout and "recall" in r.stdout and "hit rate" in r.stdout
    d = json.loads(out.read_text())
    assert len(d["layers"]) == 4 and d["totals"]["routed"] > 0


def test_chat_two_turns_through_a_pipe_prefills_only_the_new_turn(synth_model):
    from streamer.gguf_file import GGUFFile
    from streamer.tokenizer import Tokenizer

    path = synth_model("tiny", "Q8_0")
    r = invoke(
        "chat", path, "--no-think", "--system", "be brief", "-n", "5", "--seed", "3", input="hello there\nand again\n"
    )
    assert r.exit_code == 0, r.output
    prefills = [int(n) for n in re.findall(r"\[prompt: (\d+) tok", r.stderr)]
    assert len(prefills) == 2
    tok = Tokenizer.from_gguf(GGUFFile(path))
    first = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert prefills[0] == len(tok.encode_raw(first))
    # the first reply was either cut by -n (its last sampled token is fed now, then the turn closes it)
    # or ended with <|im_end|> (fed now); either way one pending token plus this turn's own text
    second_cut = "<|im_end|>\n<|im_start|>user\nand again<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    second_end = second_cut[len("<|im_end|>") :]
    assert prefills[1] in (1 + len(tok.encode_raw(second_cut)), 1 + len(tok.encode_raw(second_end)))
    assert prefills[1] < prefills[0] + 10


def test_demo_runs():
    r = invoke("demo", "-n", "4")
    assert r.exit_code == 0, r.output
    assert "hit rate" in r.stdout and "layer" in r.stdout
    assert "trained on the Python standard library" in r.stderr and re.search(
        r"expert cache .* \(128 slots, 25% of the experts", r.stderr
    )
    assert re.search(r"prefill: \d+ tokens \.\.\. done in [\d.]+ s", r.stderr)
    ids = re.search(r"generated token ids: \[([\d, ]*)\]", r.stdout)
    assert ids and len(ids.group(1).split(",")) <= 4, r.stdout


# ---- bad input: one line, exit code 2 ----


def test_bad_files(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    user_error(invoke("run", tmp_path / "notes.txt", "-p", "x"), "not a GGUF file")
    user_error(invoke("run", tmp_path / "nope.gguf", "-p", "x"), r"cannot open .*nope.gguf")
    user_error(invoke("inspect", tmp_path / "notes.txt"), "not a GGUF file")


def test_truncated_model(synth_model, tmp_path):
    src = synth_model("tiny", "Q8_0").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(src[: len(src) // 2])
    user_error(invoke("run", tmp_path / "cut.gguf", "-p", "x"), "truncated")


def test_bad_tokens_and_context(synth_model):
    path = synth_model("tiny", "Q8_0")
    user_error(
        invoke("run", path, "--tokens", "1,2,999999", "--logits-out", "x.npy"), "token id 999999 is out of range"
    )
    user_error(invoke("run", path, "--tokens", "1,a"), "comma-separated integers")
    user_error(invoke("run", path, "-p", "a long prompt that will not fit", "-c", "4"), "context overflow")
    user_error(invoke("run", path, "--logits-out", "x.npy", "-p", "hi"), "--logits-out needs --tokens")
    user_error(invoke("run", path), "exactly one of")
    user_error(invoke("run", path, "-p", "x", "--top-p", "2"), "top-p")


def test_bad_budget_and_sizes(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    user_error(invoke("run", path, "-p", "x", "--ram-budget", "lots"), "cannot read size 'lots'")
    user_error(invoke("run", path, "-p", "x", "--ram-budget", "32M"), "too small for this model: it needs at least")
    user_error(invoke("bench", path, "--pp", "0"), "--pp and --tg")


def test_outputs_are_never_written_in_place(synth_model, tmp_path):
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"precious")
    user_error(invoke("synth", out, "--preset", "tiny"), "exists")
    assert out.read_bytes() == b"precious"


def test_profiles(synth_model, tmp_path):
    from streamer.options import StreamOptions, available_presets, load_preset

    assert {"8g", "16g", "32g"} <= set(available_presets())
    assert load_preset("8g")["ram_budget"] == "7G"
    assert StreamOptions.build("8g-fast", expert_top_p=None).expert_top_p == 0.9
    assert StreamOptions.build("8g-fast", expert_top_p=1.0).expert_top_p == 1.0  # an explicit flag wins
    path = synth_model("tiny-moe", "Q8_0")
    r = invoke("run", path, "-p", "x", "-n", "2", "--profile", "8g-fast")
    assert r.exit_code == 0, r.output
    user_error(invoke("run", path, "-p", "x", "--profile", "9000g"), "unknown preset '9000g'")
    bad = tmp_path / "bad.toml"
    bad.write_text("ram_budget = '4G'\nturbo = true\n")
    user_error(invoke("run", path, "-p", "x", "--profile", bad), "unknown key 'turbo'")
    bad.write_text("ram_budget = [")
    user_error(invoke("run", path, "-p", "x", "--profile", bad), "not valid TOML")


def test_more_bad_input(synth_model, tmp_path):
    moe = synth_model("tiny-moe", "Q8_0")
    user_error(invoke("run", moe, "--tokens", ",", "--logits-out", tmp_path / "x.npy"), "no tokens")
    user_error(invoke("run", moe, "-p", "x", "--expert-top-p", "0"), r"--expert-top-p must be in \(0, 1\]")
    user_error(invoke("run", moe, "-p", "x", "--expert-top-p", "1.5"), r"--expert-top-p must be in \(0, 1\]")
    user_error(invoke("run", moe, "-p", "x", "--expert-skip", "1"), r"--expert-skip must be in \[0, 1\)")
    user_error(invoke("run", moe, "-p", "x", "--io", "fast"), "--io must be")
    user_error(invoke("run", moe, "-p", "x", "-c", "-5"), "ctx-size must be positive")
    bad = tmp_path / "p.toml"
    bad.write_text("readers = 0\n")
    user_error(invoke("run", moe, "-p", "x", "--profile", bad), "readers must be at least 1")
    user_error(invoke("synth", tmp_path / "y.gguf", "--layers", "0"), "--layers must be at least 1")


def test_context_defaults_to_the_models_limit_when_smaller(synth_model):
    path = synth_model("tiny-moe", "Q8_0")  # trained context 2048
    assert "at -c 2048" in invoke("inspect", path).stdout
    assert "at -c 512" in invoke("inspect", path, "-c", "512").stdout


def test_outputs_get_normal_permissions(synth_model, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = tmp_path / "l.npy"
        assert invoke("run", synth_model("tiny", "Q8_0"), "--tokens", "1,2", "--logits-out", out).exit_code == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
    finally:
        os.umask(old)


# Runs in a fresh interpreter with an empty numba cache: every command must refuse its bad input before
# streamer.kernels (numba) is imported, so nothing compiles and no weight is read first.
FAIL_FAST_SCRIPT = """
import json, sys, time
from streamer.cli.main import app
out = []
for args in json.loads(sys.argv[1]):
    t0 = time.perf_counter()
    try:
        app(args)
    except SystemExit as e:
        out.append([e.code, time.perf_counter() - t0])
heavy = [m for m in ("numba", "streamer.kernels", "streamer.model") if m in sys.modules]
print(json.dumps({"results": out, "heavy": heavy}))
"""


def test_bad_input_fails_before_any_kernel_is_imported(synth_model, tmp_path):
    import os
    import subprocess
    import sys

    dense, moe = synth_model("tiny", "Q8_0"), synth_model("tiny-moe", "Q8_0")
    (tmp_path / "a-dir.npy").mkdir()
    cases = [
        (["run", dense, "-p", "x", "--expert-top-p", "7"], r"--expert-top-p must be in \(0, 1\]"),  # dense too
        (["run", dense, "-p", "x", "--io", "fast"], "--io must be"),
        (["run", dense, "--tokens", "1,2,999999"], "token id 999999 is out of range"),
        (["run", moe, "--tokens", "5,-1"], "token id -1 is out of range"),
        (["run", dense, "--tokens", ",", "--logits-out", tmp_path / "x.npy"], "no tokens"),
        (["run", dense, "-p", "a long prompt that will not fit", "-c", "4"], "context overflow"),
        (["run", dense, "--tokens", "1,2", "--logits-out", tmp_path / "a-dir.npy"], "is a directory"),
        (["run", dense, "--tokens", "1,2", "--logits-out", tmp_path / "no" / "x.npy"], "no such directory"),
        (["run", dense, "-p", "x", "--top-p", "2"], "top-p"),
        (["profile", dense, "-p", "x"], "dense model"),
        (["profile", moe, "-p", "x", "--json-out", tmp_path / "no" / "p.json"], "no such directory"),
        (["profile", moe, "-p", "x" * 40, "-c", "8"], "context overflow"),
        (["bench", moe, "--pp", "64", "--tg", "8", "-c", "32"], "context overflow"),
        (["chat", moe, "--ram-budget", "lots"], "cannot read size 'lots'"),
        (["run", moe, "-p", "x", "--preset", "9000g"], "unknown preset '9000g'"),
    ]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cold"))
    p = subprocess.run(
        [sys.executable, "-c", FAIL_FAST_SCRIPT, json.dumps([[str(a) for a in c] for c, _ in cases])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    done = json.loads(p.stdout)
    assert not done["heavy"], done  # nothing compiled: the kernels were never even imported
    assert [code for code, _ in done["results"]] == [2] * len(cases), (done, p.stderr)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(cases) and "Traceback" not in p.stderr, p.stderr
    for (_, pattern), line in zip(cases, errors):
        assert re.search(pattern, line), (pattern, line)
    assert "compiling kernels" not in p.stderr
