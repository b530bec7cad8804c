"""The wheel installs one namespace: `streamer` (cli/ as streamer.cli, the preset TOMLs as streamer.presets'
data), no top-level `cli` or `profiles` that another distribution could overwrite or be overwritten by."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"streamer": "streamer", "cli": "streamer/cli", "profiles": "streamer/presets"}  # source dir -> installed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="70.1")  # a test dependency ('.[test]'): builds without network
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in MAPPED:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("stream_run-*.whl")
    return whl


def test_wheel_holds_every_source_file_under_one_namespace(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == {"streamer"}, top
    want = {
        f"{MAPPED[folder]}/{p.relative_to(ROOT / folder).as_posix()}"
        for folder in MAPPED
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts
    }
    assert want <= names, sorted(want - names)  # e.g. a new subpackage missing from pyproject's list
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "stream-run = streamer.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_runs_from_its_own_site_packages(wheel, tmp_path):
    site = tmp_path / "site"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (site / "cli").exists() and not (site / "profiles").exists()
    assert sorted(p.name for p in (site / "streamer" / "presets").glob("*.toml"))
    # the installed copy, not this checkout: run outside it, with the target first on the path (the
    # dependencies come from this interpreter's site-packages)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = [sys.executable, str(site / "bin" / "stream-run")]
    p = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert p.returncode == 0 and "presets" in p.stdout, p.stderr[-3000:]
    p = subprocess.run(run + ["presets"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert p.returncode == 0 and "low-ram" in p.stdout and "8g" in p.stdout, p.stderr[-3000:]
    code = "import streamer, streamer.cli.main, streamer.presets; print(streamer.__file__, streamer.presets.__file__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert all(Path(f).is_relative_to(site) for f in p.stdout.split()), p.stdout
