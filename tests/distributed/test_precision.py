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
from multiproc import run_ranks
from ppo_support import read_jsonl, tiny_config, without_timing, write_yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import AutoModelForSequenceClassification

from proximal import dist
from proximal.config import load_config
from proximal.models.loading import backbone, score_head
from proximal.rollout.scoring import Scorer
from proximal.trainers import ppo

#: bfloat16's unit roundoff: 8 significant bits, so rounding moves a value by at most 2^-8 of it.
BF16_U = 2.0**-8


def _ppo(cfg: dict):
    """One PPO run on this rank; its metrics rows (rank 0), the dtypes of its four models, and step
    1's scored responses of every rank as ``(prompt, response, score)``."""
    built, scored = {}, []
    original, original_score = ppo.build_models, Scorer.__call__

    def spy(*a, **kw):
        built["m"] = original(*a, **kw)
        return built["m"]

    def record(self, rollout, prompts, *a, **kw):
        total, components = original_score(self, rollout, prompts, *a, **kw)
        if not scored:  # the first call scores step 1's rollout
            scored.extend(zip(prompts, self.completions(rollout), total.tolist()))
        return total, components

    # A forked rank: patching the module and the class changes nothing in the test process.
    ppo.build_models, Scorer.__call__ = spy, record
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
    dtypes["checkpointed_blocks"] = sum(isinstance(x, CheckpointWrapper) for x in m.actor.modules())
    rows = read_jsonl(Path(cfg["output"]["dir"]) / "metrics.jsonl") if dist.is_main() else None
    first = [row for part in dist.all_gather_object(scored) for row in part]
    return rows, dtypes, first


def bf16_score_scale(reward_model: Path) -> float:
    """How far bfloat16 can move a score of this reward model: one unit roundoff of the largest sum
    its terms can make.

    The score is s = w·h, the head's weights w (hidden size d) against the last token's final
    RMSNorm output h = g ⊙ x / rms(x), whose norm is at most max|g|·√d. The terms w_i·h_i sum to a
    score of about 0.1 after cancelling, but in magnitude to as much as ‖w‖·max|g|·√d (Cauchy–
    Schwarz); rounding them to 8 bits (and the blocks before them) moves s by the order of 2^-8
    of that sum, not of s itself. Here ‖w‖ ≈ 0.125, g = 1, d = 32: 2.8e-3; the four responses
    below measured 0.04e-3 to 0.92e-3.
    """
    rm = AutoModelForSequenceClassification.from_pretrained(str(reward_model))
    w = score_head(rm).weight.detach()
    g = backbone(rm).norm.weight.detach()
    return BF16_U * float(w.norm()) * float(g.abs().max()) * math.sqrt(g.numel())


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
    rows, dtypes, half = run_ranks(
        world, _ppo, _cfg(assets, tmp_path / "run", precision="bf16-mixed")
    )[0]
    assert dtypes["actor"] == {torch.float32} and dtypes["critic"] == {torch.float32}
    assert dtypes["reference"] == {torch.bfloat16} and dtypes["reward_model"] == {torch.bfloat16}
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["loss/value"]) for r in rows)

    # The same run in float32: each response the bfloat16 reward model scored, against its float32
    # score, within bfloat16's rounding (a zeroed score is off by over 20 times that for one of
    # them; another model's score by as much as the scores themselves). Only identical responses
    # compare: bfloat16's logits could flip a sampled token on another CPU; here all four match.
    full_rows, _, full = run_ranks(1, _ppo, _cfg(assets, tmp_path / "fp32"))[0]
    tol = bf16_score_scale(assets.reward_model("llama"))
    assert len(half) == len(full) == 4  # rollout.batch_size, gathered over the ranks
    full_by_prompt = {p: (r, s) for p, r, s in full}
    same = [(s, full_by_prompt[p][1]) for p, r, s in half if full_by_prompt[p][0] == r]
    assert len(same) >= 3, f"bfloat16 sampled other responses: {half} against {full}"
    assert max(abs(f) for _, f in same) > 20 * tol  # the scores are far from trivially small
    for h, f in same:
        assert abs(h - f) <= tol, (h, f, tol)
    # The logged batch mean is the same scores' mean (over both ranks when there are two)
    if len(same) == len(full):
        assert rows[0]["score/mean"] == pytest.approx(full_rows[0]["score/mean"], abs=tol)
        assert abs(full_rows[0]["score/mean"]) > 10 * tol


def test_bf16_true_holds_everything_in_bfloat16(assets, tmp_path):
    rows, dtypes, _ = run_ranks(1, _ppo, _cfg(assets, tmp_path / "run", precision="bf16-true"))[0]
    assert all(d == {torch.bfloat16} for k, d in dtypes.items() if k != "checkpointed_blocks")
    assert len(rows) == 2


@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_changes_no_number(assets, tmp_path, world):
    plain, d0, _ = run_ranks(world, _ppo, _cfg(assets, tmp_path / "plain"))[0]
    ckpt, d1, _ = run_ranks(
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
