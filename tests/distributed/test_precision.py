"""``train.precision`` and ``train.activation_checkpointing``, in one process and in two.

bf16-mixed keeps float32 master weights and optimiser states (the trained model's parameters stay
float32, only the forward computes in bfloat16) and holds the frozen models in bfloat16; bf16-true
holds everything in bfloat16. Activation checkpointing recomputes the blocks in backward: the same
numbers, less memory.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from multiprocess import run_ranks
from ppo_support import read_jsonl, tiny_config, without_timing, write_yaml


def _ppo(cfg: dict):
    from proximal import dist
    from proximal.config import load_config
    from proximal.trainers import ppo

    built = {}
    original = ppo.build_models

    def spy(*a, **kw):
        built["m"] = original(*a, **kw)
        return built["m"]

    ppo.build_models = spy
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        write_yaml(path, cfg)
    dist.barrier()
    ppo.train(load_config(ppo.PPOConfig, path))
    m = built["m"]
    dtypes = {
        "actor": {p.dtype for p in m.actor.parameters()},
        "critic": {p.dtype for p in m.critic.parameters()},
        "reference": {p.dtype for p in m.reference.model.parameters()},
        "reward_model": {p.dtype for p in m.scorer.reward_model.parameters()},
    }
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    dtypes["checkpointed_blocks"] = sum(isinstance(x, CheckpointWrapper) for x in m.actor.modules())
    rows = read_jsonl(Path(cfg["output"]["dir"]) / "metrics.jsonl") if dist.is_main() else None
    return rows, dtypes


def _cfg(assets, run_dir, **train):
    return tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        ppo={"epochs": 1, "mini_batch_size": 4, "micro_batch_size": 2},
        train={"steps": 2, "save_every": 0, **train},
    )


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_mixed_keeps_float32_master_weights(assets, tmp_path, world):
    rows, dtypes = run_ranks(world, _ppo, _cfg(assets, tmp_path / "run", precision="bf16-mixed"))[0]
    assert dtypes["actor"] == {torch.float32} and dtypes["critic"] == {torch.float32}
    assert dtypes["reference"] == {torch.bfloat16} and dtypes["reward_model"] == {torch.bfloat16}
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["loss/value"]) for r in rows)
    full, _ = run_ranks(1, _ppo, _cfg(assets, tmp_path / "fp32"))[0]
    # Same run in float32: bfloat16 (8 bits of mantissa) moves the first step's statistics a little
    assert rows[0]["score/mean"] == pytest.approx(full[0]["score/mean"], abs=0.1)


def test_bf16_true_holds_everything_in_bfloat16(assets, tmp_path):
    rows, dtypes = run_ranks(1, _ppo, _cfg(assets, tmp_path / "run", precision="bf16-true"))[0]
    assert all(d == {torch.bfloat16} for k, d in dtypes.items() if k != "checkpointed_blocks")
    assert len(rows) == 2


@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_changes_no_number(assets, tmp_path, world):
    plain, d0 = run_ranks(world, _ppo, _cfg(assets, tmp_path / "plain"))[0]
    ckpt, d1 = run_ranks(
        world, _ppo, _cfg(assets, tmp_path / "ckpt", activation_checkpointing=True)
    )[0]
    assert (d0["checkpointed_blocks"], d1["checkpointed_blocks"]) == (
        0,
        2,
    )  # both blocks of the tiny llama
    for a, b in zip(plain, ckpt):
        a, b = without_timing(a), without_timing(b)
        for k in a:
            if isinstance(a[k], float):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)
