"""docs/python.md's script runs: every ```python block of the page, in order, as one script, in a
fresh interpreter in an empty directory (blocks fenced ```python notest are examples of other calls
and are not run). The page says it runs in well under a minute on a laptop CPU; here it must finish
within the timeout below, and leave the run directories it says it makes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "python.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def script() -> str:
    blocks = BLOCK.findall(PAGE.read_text())
    assert len(blocks) >= 5, "docs/python.md has lost its script"
    return "\n\n".join(blocks)


def test_the_python_page_runs(tmp_path):
    (tmp_path / "script.py").write_text(script())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for name in ("sft", "rm", "ppo", "grpo"):
        assert (tmp_path / "runs" / name / "config.json").is_file(), name
        assert (tmp_path / "runs" / name / "metrics.jsonl").is_file(), name
    # the script's own lines (the runs print notes of their own: the CPU's matmul, ...)
    printed = [line for line in done.stdout.splitlines() if line.startswith(("SFT", "PPO", "GRPO"))]
    assert [line.split()[0] for line in printed] == ["SFT", "PPO", "GRPO", "GRPO's"], printed
    assert printed[3].startswith("GRPO's reward at each step: ["), printed
