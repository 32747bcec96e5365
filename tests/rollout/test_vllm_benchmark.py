"""benchmarks/engines.py (issue 41) keeps working: its ``--quick`` generation part end to end, both
engines in one child process. A benchmark is not a test: nothing here asserts a time.

Needs vLLM (``.venv-vllm``): carries the ``vllm`` marker like the engine's own tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_engines_quick_generation_writes_both_engines_figures(tmp_path):
    out = tmp_path / "engines.md"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "engines.py"),
            "--quick",
            "--parts",
            "gen",
            "--threads",
            "1",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    (gen,) = data["gen"]
    assert gen["shape"]["name"] == "tiny" and gen["new_tokens"] == 8
    # one round: each engine generated the one batch once (every row exactly 8 tokens: the child
    # checks the shape of every call), after its own start and warm-up
    assert sorted((x["engine"], x["batch"]) for x in gen["runs"]) == [("hf", 2), ("vllm", 2)]
    assert all(x["tokens_per_s"] > 0 for x in gen["runs"])
    assert gen["vllm_decode"]["path"] == "vllm" and gen["vllm_decode"]["dtype"] == "float32"
    assert gen["start_s"]["vllm"] > 0 and gen["push_s"] > 0
    assert set(data["crossover"]) == {"tiny"}
    assert "| tiny | 0.255M | 2 |" in out.read_text()
