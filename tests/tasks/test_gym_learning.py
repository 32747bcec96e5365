"""Learning on a reasoning-gym task, reduced: ``proximal compare --compare.task
reasoning_gym:chain_sum`` with one seed, a 300-step SFT on the sloppy teacher (55 % right, 15 %
without the ``<answer>`` tags) and 1 920 responses (30 steps of 64) per RL method; each policy
evaluated on the 256 held-out questions (none a training question) × 2 samples.

What it requires is what the reduced run measured clearly (docs/tasks.md, the reasoning-gym table):
every RL method brings the format errors below half the SFT model's. Exact match is printed, not
asserted: at this budget its changes (±0.03) are within the noise of 512 held-out responses (standard
error of a difference up to 0.031). Minutes on a CPU: marker ``learning``, deselected by ``make
test``, run by ``make test-learning``.
"""

from __future__ import annotations

import json

import pytest
import yaml

from proximal.cli import main
from proximal.compare import task_configs

pytestmark = pytest.mark.learning

METHODS = ("ppo@verifier", "grpo@verifier", "rloo@verifier")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chain_sum")
    configs = tmp / "configs"
    configs.mkdir()
    for f in task_configs("reasoning_gym:chain_sum").glob("*.yaml"):
        (configs / f.name).write_text(f.read_text())
    sft = yaml.safe_load((configs / "sft.yaml").read_text())
    sft["train"].update(steps=300, eval_every=100)
    (configs / "sft.yaml").write_text(yaml.safe_dump(sft))
    out = tmp / "out"
    argv = ["compare", "--compare.task", "reasoning_gym:chain_sum", "--compare.configs"]
    assert (
        main(
            [
                *argv,
                str(configs),
                "--compare.seeds",
                "1",
                "--compare.responses",
                "1920",
                "--compare.evaluations",
                "2",
                "--output.dir",
                str(out),
                "--output.progress",
                "false",
            ]
        )
        == 0
    )
    table = {"sft": json.loads((out / "sft_eval.json").read_text())["mean"]}
    for m in METHODS:
        table[m] = json.loads((out / "runs" / f"{m}-seed0" / "eval.json").read_text())["final"][
            "mean"
        ]
    print("\npolicy         exact_match  format_error  kl")
    for name, row in table.items():
        print(
            f"{name:<14} {row['gold']:.3f}        {row['format_error']:.3f}         {row['kl']:.3f}"
        )
    return table


@pytest.mark.parametrize("method", METHODS)
def test_rl_halves_the_sft_models_format_errors(measured, method):
    assert measured[method]["format_error"] < measured["sft"]["format_error"] / 2, measured
