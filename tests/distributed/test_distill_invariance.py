"""``proximal distill`` on 1 process and on 2 (FSDP2 over gloo, the teacher sharded under
``model.frozen_sharding``): the same per-step metrics and the same final weights, for the reverse-KL
loss with a verifier's reward and for the JSD loss — to the tolerances (and for the reasons) of
``tests/distributed/test_run_invariance.py``: relative 1e-4 with an absolute floor of 1e-4 on the
metrics; the 99.9th percentile of |Δw| ≤ 2e-5 and every |Δw| ≤ 2·lr on the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_support import assert_same_runs, train_in_rank
from multiproc import run_ranks

LR = 1e-3


@pytest.fixture(scope="module")
def teacher(assets, tmp_path_factory):
    from proximal.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("teacher") / "t", assets.tokenizer, arch="llama", seed=7
    )


def _config(assets, teacher, run_dir: Path, **distill) -> dict:
    prompts = assets.prompts
    if distill.get("lam"):  # teacher-written completions in a column of the prompts
        from ppo_support import prompt_texts

        from proximal.data.jsonl import write_jsonl

        prompts = run_dir.parent / "written.jsonl"
        rows = [
            {"prompt": p, "completion": "ab" * (1 + i % 3)} for i, p in enumerate(prompt_texts())
        ]
        write_jsonl(prompts, rows)
    return {
        "model": {
            "path": str(assets.policy("llama")),
            "teacher": str(teacher),
            "reward_functions": ["ppo_support:frac_a"],
        },
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 4, "group_size": 2, "max_new_tokens": 6},
        "distill": {"iterations": 2, "mini_batch_size": 4, "micro_batch_size": 1, **distill},
        "optim": {"lr": LR},
        "train": {"steps": 3, "seed": 0, "device": "cpu", "save_every": 0},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 0},
    }


@pytest.mark.parametrize(
    "distill",
    [
        {"reward_weight": 0.5},
        {"loss": "jsd", "beta": 0.5, "reward_weight": 0.0},
        {"loss": "jsd", "lam": 0.5, "reward_weight": 0.0},
    ],
    ids=["reverse_kl+reward", "jsd", "jsd+lam"],
)
def test_distill_1_vs_2_processes(assets, teacher, tmp_path, distill):
    one = run_ranks(
        1, train_in_rank, "distill", _config(assets, teacher, tmp_path / "w1", **distill)
    )[0]
    two = run_ranks(
        2, train_in_rank, "distill", _config(assets, teacher, tmp_path / "w2", **distill)
    )[0]
    assert_same_runs(one, two, steps=3, lr=LR)
    rows = one[0]
    assert all(r["grad_norm/actor"] > 0 for r in rows)  # the run moved
    if distill.get("lam"):  # some rows of the run were teacher-written, not all
        assert 0 < sum(r["distill/teacher_written_frac"] for r in rows) < len(rows)
