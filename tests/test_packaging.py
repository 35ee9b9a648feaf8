"""`pip install .` from a clone: the wheel pip builds holds every module, the dashboard's files,
the `rlplex` command and the extras the README names, and what it installs imports and runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from timing import scaled

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


def test_pip_installs_a_clone_with_its_command_package_data_and_extras(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # No index, no build isolation: the machines reach only the package registries, and setuptools
    # is in the venv already (a user's `pip install .` fetches it the same way).
    wheel_dir = tmp_path / "dist"
    build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".", "-w", str(wheel_dir)]
    subprocess.run(build, cwd=clone, check=True, timeout=scaled(120))
    (wheel,) = wheel_dir.glob("rlplex-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    modules = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "rlplex").rglob("*.py")}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert {"rlplex/dashboard/static/index.html", "rlplex/dashboard/static/uplot/uPlot.iife.min.js"} <= names
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]
    extras = {line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    assert {"vllm", "atari", "mujoco", "gguf", "dev"} <= extras, extras
    assert "rlplex = rlplex.cli:main" in entry_points

    site = tmp_path / "site"
    subprocess.run([*PIP, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True)
    probe = (
        "import importlib.resources as r, rlplex, rlplex.cli; print(rlplex.__file__); "
        "print(r.files('rlplex.dashboard').joinpath('static/index.html').is_file())"
    )
    # The installed copy, not this checkout's src (which the venv's editable install points at).
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(60)
    )
    assert done.returncode == 0, done.stderr
    where, has_page = done.stdout.split()
    assert Path(where).is_relative_to(site) and has_page == "True", done.stdout
    assert (site / "bin" / "rlplex").is_file()  # the console script
