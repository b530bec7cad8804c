"""The machine's state beside bench's figures: the ISA as LLVM (what numba compiles for) sees it, the parsing
of /proc and /sys by hand, and `bench` recording it with its results."""

import json

import pytest
from test_cli import invoke

from streamer import machine
from streamer.kernels import cpu, int8


def test_isa_names_by_hand():
    assert machine.isa_name({"avx2", "avx512f", "avx512_vnni"}) == "AVX-512/VNNI"
    assert machine.isa_name({"avx2", "avx512f"}) == "AVX-512"
    assert machine.isa_name({"avx2", "fma"}) == "AVX2 only"
    assert machine.isa_name({"sse4_2"}) is None


@pytest.mark.skipif(not cpu.X86, reason="x86 only")
def test_isa_agrees_with_llvm():
    isa = machine.describe()["isa"]
    assert isa.startswith("AVX-512") == cpu.has("avx512f")
    assert isa.endswith("VNNI") == cpu.has("avx512f", "avx512vnni")
    assert (isa == "AVX2 only") == (cpu.has("avx2") and not cpu.has("avx512f"))


def test_state_fields():
    s = machine.describe()
    mem = s["memory"]
    assert 0 < mem["MemFree"] <= mem["MemTotal"] and 0 < mem["MemAvailable"] <= mem["MemTotal"]
    assert s["thp_enabled"] in (None, "always", "madvise", "never")
    assert s["free_page_reporting"] in (None, True, False)
    assert s["vmstat"]["pgfault"] > 0
    bytes_ = bytearray(64 * 2**20)  # touched: at least 64 MiB / 4 KiB page faults, machine-wide
    bytes_[::4096] = b"x" * len(bytes_[::4096])
    assert machine.during(s)["pgfault"] >= 64 * 2**20 // 4096 // 2  # THP may map some of it in larger pages


def test_cpu_steal_from_proc_stat_by_hand():
    # /proc/stat's format (proc(5)): cpu user nice system idle iowait irq softirq steal guest guest_nice
    text = "cpu  100 5 50 800 10 0 5 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n"
    assert machine.cpu_times(text) == (30, 1000)
    assert machine.cpu_times("intr 1 2 3\n") is None
    s = machine.describe()
    sum(i * i for i in range(3_000_000))  # some CPU time passes (clock ticks are 10 ms)
    d = machine.during(s)
    if s["cpu_times"] is not None:
        assert 0.0 <= d["steal_share"] <= 1.0


def test_bench_records_the_machine(synth_model):
    path = synth_model("tiny-moe", "Q8_0")
    r = invoke("bench", path, "--pp", "4", "--tg", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["machine"]["isa"] == machine.describe()["isa"] and out["machine"]["cpus"] >= 1
    assert out["machine"]["activation_digits"] == int8.DIGITS
    assert out["machine_during"]["pgfault"] >= 0
    text = invoke("bench", path, "--pp", "4", "--tg", "3")
    assert "machine  " in text.stdout and "free page reporting" in text.stdout
    assert f"activations as {int8.DIGITS} int8 digit" in text.stdout


def test_kernels_follow_the_features_numba_is_told_to_compile_for():
    """NUMBA_CPU_FEATURES (an AVX2-only list here) makes numba compile for that CPU: the kernels' instruction-set
    choices follow it (a VNNI kernel would not compile for it)."""
    import os
    import subprocess
    import sys

    avx2 = "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"
    code = (
        "import json; from streamer.kernels import cpu, int8, lanes; "
        "print(json.dumps([cpu.has('avx512f'), cpu.has('avx2'), int8.ISA, int8.DECODE_ISA, lanes.host_isa(), "
        "int8.DIGITS]))"
    )
    # and activations as one int8 digit there (int8.activation_digits), unless STREAM_RUN_ACT says otherwise
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": avx2}
    for act, digits in (("", 1), ("int16", 2)):
        env["STREAM_RUN_ACT"] = act
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) == [False, True, "avx2", "avx2", "avx2", digits]


def test_kernel_isa_follows_numba_cpu_features(monkeypatch):
    """kernels/cpu.py compiles for NUMBA_CPU_FEATURES when it is set (LLVM's names): the record says so."""
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    s = machine.describe()
    assert s["kernel_isa"] == s["isa"] and "kernels for" not in machine.line(s)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx,+avx2,+fma,-avx512f,-avx512vnni")
    s = machine.describe()
    assert s["kernel_isa"] == "AVX2 only (NUMBA_CPU_FEATURES)"
    assert "kernels for AVX2 only (NUMBA_CPU_FEATURES)" in machine.line(s)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+avx512f,+avx512vnni")
    assert machine.describe()["kernel_isa"] == "AVX-512/VNNI (NUMBA_CPU_FEATURES)"
