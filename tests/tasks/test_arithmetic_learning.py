"""Learning on the arithmetic reasoning task: GRPO and PPO rewarded by the answer verifier raise
held-out exact match clearly above the SFT model they start from, on every one of 3 seeds.

Each seed runs the demo's own arithmetic stages at full size (``configs/demo/arithmetic/``: the
task's data, SFT on the sloppy teacher, then GRPO and PPO from that SFT model) and evaluates the
three policies on the held-out prompts with one sampling seed (common random numbers).
Minutes per seed on a CPU: marker ``learning``, deselected by ``make test``, run by
``make test-learning``.

The threshold (:data:`MIN_GAIN` = 0.10) from the measured table (docs/tasks.md, 3 seeds, at
85183cf): exact-match gains over SFT of 0.164, 0.291, 0.352 (GRPO) and 0.195, 0.279, 0.355 (PPO),
mean 0.27 and sample std 0.08 over the six. A gain is a difference of two held-out exact-match
rates over the same N = 512 responses (256 prompts × 2); each rate's standard error is at most
sqrt(0.25 / 512) = 0.022, so at three standard errors a difference of two independent ones is
within sqrt(2) × 0.022 × 3 = 0.094 of its mean (common random numbers make it smaller). 0.10 is
above that noise floor — a policy that learned nothing (expected gain 0) clears it with probability
below 0.2 % — and 0.064 below the smallest gain measured, about one standard deviation of the
measured spread.
"""

from __future__ import annotations

import pytest

from proximal.demo import (
    ARITHMETIC_SCORES,
    DEFAULT_CONFIGS,
    EVAL_PROMPT_TOKENS,
    FULL,
    arithmetic_stage_configs,
)
from proximal.evaluation import evaluate_policy
from proximal.logging import read_metrics
from proximal.methods import final_policy
from proximal.tasks import arithmetic
from proximal.trainers import grpo, ppo, sft

pytestmark = pytest.mark.learning

SEEDS = (0, 1, 2)
#: See the module docstring: above three standard errors of a difference of two held-out rates.
MIN_GAIN = 0.10


def _one_seed(out, seed: int) -> dict:
    arithmetic.make_task_data(out / "task", seed)
    cfgs = arithmetic_stage_configs(DEFAULT_CONFIGS / "arithmetic", out, seed, FULL)
    sft.train(cfgs["sft"][0])
    grpo.train(cfgs["grpo"][0])
    ppo.train(cfgs["ppo"][0])
    grpo.train(cfgs["rloo"][0])  # measured for the table; the test asserts GRPO and PPO
    policies = {"sft": out / "sft", **{m: final_policy(out / m) for m in ("grpo", "ppo", "rloo")}}
    table = {
        name: evaluate_policy(
            path,
            reference=out / "sft",
            prompts_file=out / "task" / "prompts_eval.jsonl",
            scores=ARITHMETIC_SCORES,
            samples_per_prompt=2,
            max_new_tokens=arithmetic.MAX_RESPONSE_TOKENS,
            max_prompt_length=EVAL_PROMPT_TOKENS,
            seed=seed,
        )["mean"]
        for name, path in policies.items()
    }
    for name in ("sft", "grpo", "ppo", "rloo"):  # training wall time, from the run's own metrics
        table[name]["wall_s"] = list(read_metrics(out / name / "metrics.jsonl"))[-1]["time/wall_s"]
    return table


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    table = {seed: _one_seed(tmp_path_factory.mktemp(f"arith{seed}"), seed) for seed in SEEDS}
    print("\nseed  policy  exact_match  format_error  kl     length  wall_s")
    for seed, row in table.items():
        for name, m in row.items():
            print(
                f"{seed:<5} {name:<7} {m['exact_match']:.3f}        {m['format_error']:.3f}"
                f"         {m['kl']:.3f}  {m['length']:.1f}    {m['wall_s']:.0f}"
            )
    return table


@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_the_verifier_raises_held_out_exact_match_above_sft(measured, method):
    gains = {
        s: row[method]["exact_match"] - row["sft"]["exact_match"] for s, row in measured.items()
    }
    assert all(g > MIN_GAIN for g in gains.values()), gains
