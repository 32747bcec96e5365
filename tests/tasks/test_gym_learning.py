"""Learning on a reasoning-gym task: ``proximal compare --compare.task reasoning_gym:chain_sum`` with
the packaged configs (a 1 000-step SFT on the sloppy teacher's worked solutions, 55 % right, 15 %
without the ``<answer>`` tags; PPO, GRPO and RLOO from it) for seed 0, at the measured size: 1 920
responses (30 steps of 64) per RL method, each policy evaluated on the 256 held-out questions (none
a training question) × 8 samples, N = 2 048.

What it requires held on all 3 seeds of both tasks in the measurement (docs/tasks.md, the
reasoning-gym table), each against three standard errors of the paired difference — per held-out
question, the policy's share of right answers less the SFT model's; their standard deviation over
the 256 questions / √256 — computed from the rows of this run:

- every RL stage gains exact match: its gain exceeds three standard errors and MIN_GAIN (measured
  +0.082 … +0.141 over the 18 runs, 4.6 to 10.3 standard errors; MIN_GAIN is the smallest gain
  halved and rounded down);
- every RL stage removes format errors: its drop exceeds three standard errors (measured 0.11 …
  0.15, 12 to 18 standard errors).

pass@8 and maj@8 are reported, not required: no method raised pass@8 on average, and the methods'
mean maj@8 moved by 0.04 at most either way (docs/tasks.md).

Minutes on a CPU: marker ``learning``, deselected by ``make test``, run by ``make test-learning``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

import pytest

from proximal.cli import main

pytestmark = pytest.mark.learning

METHODS = ("ppo@verifier", "grpo@verifier", "rloo@verifier")
#: Every RL stage's held-out exact match gain over the SFT model exceeds this (see the module).
MIN_GAIN = 0.04


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain_sum") / "out"
    argv = ["compare", "--compare.task", "reasoning_gym:chain_sum", "--compare.seeds", "1"]
    assert (
        main(
            [
                *argv,
                "--compare.responses",
                "1920",
                "--compare.evaluations",
                "1",
                "--compare.eval_samples_per_prompt",
                "8",
                "--compare.eval_pass_k",
                "[1, 8]",
                "--output.dir",
                str(out),
                "--output.progress",
                "false",
            ]
        )
        == 0
    )
    rows = {"sft": json.loads((out / "sft_eval.json").read_text())["rows"]}
    for m in METHODS:
        run = out / "runs" / f"{m}-seed0" / "eval.json"
        rows[m] = json.loads(run.read_text())["final"]["rows"]
    print("\npolicy         exact_match  format_error  kl")
    for name, rs in rows.items():
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("gold", "format_error", "kl")}
        print(
            f"{name:<14} {mean['gold']:.3f}        {mean['format_error']:.3f}         {mean['kl']:.3f}"
        )
    return rows


def paired(sft: list[dict], policy: list[dict], key: str) -> tuple[float, float]:
    """The mean over held-out questions of the policy's rate less the SFT model's, and its standard
    error."""

    def per_question(rows):
        by = defaultdict(list)
        for r in rows:
            by[r["prompt"]].append(r[key])
        return {q: sum(v) / len(v) for q, v in by.items()}

    a, b = per_question(sft), per_question(policy)
    assert a.keys() == b.keys() and len(a) == 256
    d = [b[q] - a[q] for q in a]
    return statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))


@pytest.mark.parametrize("method", METHODS)
def test_every_rl_stage_gains_exact_match(measured, method):
    gain, se = paired(measured["sft"], measured[method], "gold")
    assert gain > max(3 * se, MIN_GAIN), (gain, se)


@pytest.mark.parametrize("method", METHODS)
def test_every_rl_stage_removes_format_errors(measured, method):
    change, se = paired(measured["sft"], measured[method], "format_error")
    assert change < -3 * se, (change, se)
