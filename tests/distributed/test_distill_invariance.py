"""``proximal distill`` on 1 process and on 2 (FSDP2 over gloo, the teacher sharded under
``model.frozen_sharding``): the same per-step metrics and the same final weights, for the reverse-KL
loss with a verifier's reward and for the JSD loss — to the tolerances (and for the reasons) of
``tests/distributed/test_run_invariance.py``: relative 1e-4 with an absolute floor of 1e-4 on the
metrics; the 99.9th percentile of |Δw| ≤ 2e-5 and every |Δw| ≤ 2·lr on the weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from multiproc import run_ranks
from ppo_support import TIMING_PREFIXES, load_safetensors_dir, read_jsonl

REL, ABS, LR = 1e-4, 1e-4, 1e-3


def _train(cfg: dict):
    """Inside a rank: ``distill.train`` on ``cfg``; rank 0 returns its metrics and final weights."""
    import yaml

    from proximal import dist
    from proximal.config import load_config
    from proximal.trainers import distill

    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        path.write_text(yaml.safe_dump(cfg))
    dist.barrier()
    run_dir = distill.train(load_config(distill.DistillConfig, path))
    if not dist.is_main():
        return None
    return read_jsonl(run_dir / "metrics.jsonl"), load_safetensors_dir(run_dir)


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)
    return a == b


def _compare(one, two) -> None:
    import torch

    (rows1, w1), (rows2, w2) = one, two
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == [1, 2, 3]
    for a, b in zip(rows1, rows2, strict=True):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(TIMING_PREFIXES)}
        diff = {k: (a.get(k), b.get(k)) for k in keys if not _close(a.get(k), b.get(k))}
        assert not diff, f"step {a['step']}: 1 vs 2 processes: {diff}"
    assert w1.keys() == w2.keys()
    d = torch.cat([(w1[k].float() - w2[k].float()).abs().flatten() for k in sorted(w1)])
    assert float(torch.quantile(d, 0.999)) <= 2e-5
    assert float(d.max()) <= 2 * LR


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
    one = run_ranks(1, _train, _config(assets, teacher, tmp_path / "w1", **distill))[0]
    two = run_ranks(2, _train, _config(assets, teacher, tmp_path / "w2", **distill))[0]
    _compare(one, two)
    rows = one[0]
    assert all(r["grad_norm/actor"] > 0 for r in rows)  # the run moved
    if distill.get("lam"):  # some rows of the run were teacher-written, not all
        assert 0 < sum(r["distill/teacher_written_frac"] for r in rows) < len(rows)
