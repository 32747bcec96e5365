"""A plain (non-editable) install carries everything the commands need: the demo's configs live in
the package and the wheel ships them. (A fresh-virtualenv ``pip install .`` followed by
``proximal demo --quick`` was run by hand for the closing note of issue 8; building the wheel is
the part that can regress silently, and it takes a couple of seconds.)"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_configs_are_package_data():
    from proximal.demo import DEFAULT_CONFIGS

    assert DEFAULT_CONFIGS.is_relative_to(ROOT / "proximal")
    for name in ("sft.yaml", "rm.yaml", "ppo.yaml", "ppo_overopt.yaml"):
        assert (DEFAULT_CONFIGS / name).is_file(), name


def test_the_wheel_ships_the_demo_configs(tmp_path):
    import shutil

    src = (
        tmp_path / "src"
    )  # a clean copy: setuptools' build/ would otherwise keep files deleted since
    shutil.copytree(
        ROOT / "proximal", src / "proximal", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("proximal_rlhf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("sft.yaml", "rm.yaml", "ppo.yaml", "ppo_overopt.yaml"):
        assert f"proximal/configs/demo/{name}" in names, name
    assert "proximal/__main__.py" in names  # torchrun -m proximal
