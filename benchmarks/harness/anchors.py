"""The anchors' virtual environments: one per anchor, git-ignored, created (or refreshed when their
pins change) by the harness itself.

``benchmarks/.venv-trl-ppo``: TRL 1.12.0, the last release with PPOTrainer (``trl.experimental.ppo``).
``benchmarks/.venv-trl-grpo``: the newest TRL when this was written (1.16.0) for GRPOTrainer.
Both: torch 2.13.0 installed **first** and alone (a CPU wheel here; a bare ``torch`` requirement
would pull a multi-GB CUDA build), then every other package at the version in
``benchmarks/anchors/<name>.txt``, so a rerun installs exactly the same environment.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Anchor:
    name: str  # trl-ppo | trl-grpo
    runner: str  # the script it runs, in benchmarks/

    @property
    def venv(self) -> Path:
        return BENCH / f".venv-{self.name}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def lock(self) -> Path:
        return BENCH / "anchors" / f"{self.name}.txt"

    def stamp(self) -> str:
        return hashlib.sha256((TORCH + "\n" + self.lock.read_text()).encode()).hexdigest()[:16]


ANCHORS = {
    "trl-ppo": Anchor("trl-ppo", "trl_ppo_run.py"),
    "trl-grpo": Anchor("trl-grpo", "trl_grpo_run.py"),
}


def ensure(anchor: Anchor, log=print, python: str | None = None) -> Path:
    """The anchor's Python, creating or refreshing its environment first if its stamp is not the pins'."""
    stamp_file = anchor.venv / ".pins"
    if (
        anchor.python.exists()
        and stamp_file.is_file()
        and stamp_file.read_text().strip() == anchor.stamp()
    ):
        return anchor.python
    log(
        f"[anchors] installing {anchor.name} into {anchor.venv} (torch first, then {anchor.lock.name}) ..."
    )
    base = python or _base_python()
    if not anchor.python.exists():
        subprocess.run([base, "-m", "venv", str(anchor.venv)], check=True)
    pip = [str(anchor.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [TORCH], check=True)
    subprocess.run(pip + ["-r", str(anchor.lock)], check=True)
    stamp_file.write_text(anchor.stamp() + "\n")
    log(f"[anchors] {anchor.name} ready")
    return anchor.python


def _base_python() -> str:
    """A Python to make the venv from: the interpreter under proximal's venv (``sys.base_prefix``)."""
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(exe if exe.exists() else sys.executable)


def versions(python: Path) -> dict:
    """torch / transformers / trl / accelerate / datasets versions of an environment."""
    code = (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        "for n in ('torch', 'transformers', 'trl', 'accelerate', 'datasets'):\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    import json

    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)
