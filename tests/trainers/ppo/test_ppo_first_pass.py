"""``ppo.reuse_first_pass``: log π_old from the first epoch's own actor forward.

When the batch is one mini-batch of one micro-batch on one process, the first epoch's actor forward
sees exactly the rollout, so its detached log-probabilities are log π_old and the experience's actor
pass is skipped. These tests check that it is the same run (metrics and
weights against the run with separate passes), that the passes really are skipped (forwards
counted), that the first epoch's ratio is then exactly 1, and that it stays off where the first
epoch's forwards see other rows.
"""

from __future__ import annotations

import pytest
import torch
from ppo_support import (
    checkpoint_dirs,
    load_safetensors_dir,
    ppo_main,
    read_jsonl,
    tiny_config,
    without_timing,
)


def _config(assets, run_dir, *, reuse: bool, micro: int = 4, **extra):
    ppo = {
        "epochs": 2,
        "mini_batch_size": 4,
        "micro_batch_size": micro,
        "reuse_first_pass": reuse,
        **extra.pop("ppo", {}),
    }
    return tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        ppo=ppo,
        train={"steps": 3},
        **extra,
    )


def _count_forwards(monkeypatch):
    """Forward passes of the actor and critic in the update (``trainers.ppo``) and in the experience
    (``rollout.experience``), by wrapping the functions each module calls."""
    from proximal.rollout import experience
    from proximal.trainers import ppo

    counts = {}

    def wrap(module, name, key):
        fn = getattr(module, name)

        def counted(*args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    wrap(ppo, "response_logprobs", "update_actor")
    wrap(ppo, "critic_values", "update_critic")
    wrap(experience, "response_logprobs", "experience_logits")  # π_old and π_ref
    wrap(experience, "critic_values", "experience_critic")
    return counts


def _run(config, monkeypatch):
    counts = _count_forwards(monkeypatch)
    assert ppo_main(config) == 0
    return counts


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_same_run_with_one_forward_fewer(assets, tmp_path, monkeypatch, entropy_coef):
    runs = {}
    for reuse in (False, True):
        with monkeypatch.context() as mp:
            cfg = _config(
                assets, tmp_path / f"reuse-{reuse}", reuse=reuse, ppo={"entropy_coef": entropy_coef}
            )
            runs[reuse] = (_run(cfg, mp), tmp_path / f"reuse-{reuse}")
    (separate, sep_dir), (reused, reuse_dir) = runs[False], runs[True]
    steps, epochs = 3, 2
    # separate passes: π_old, π_ref and V_old in the experience, one forward of each model per epoch
    assert separate == {
        "update_actor": steps * epochs,
        "update_critic": steps * epochs,
        "experience_logits": 2 * steps,
        "experience_critic": steps,
    }
    # reused: the experience runs π_ref and V_old only; the first epoch's actor forward is the first pass's
    assert reused == {
        "update_actor": steps * epochs,
        "update_critic": steps * epochs,
        "experience_logits": steps,
        "experience_critic": steps,
    }

    a, b = read_jsonl(sep_dir / "metrics.jsonl"), read_jsonl(reuse_dir / "metrics.jsonl")
    assert len(a) == len(b) == steps
    for ra, rb in zip(a, b):
        ra, rb = without_timing(ra), without_timing(rb)
        assert ra.keys() == rb.keys()
        for k in ra:
            # float32 round-off of the rows' summation order (the separate first epoch sees them shuffled)
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (ra["step"], k)
    for part in ("policy", "critic"):
        wa = load_safetensors_dir(checkpoint_dirs(sep_dir)[-1] / part)
        wb = load_safetensors_dir(checkpoint_dirs(reuse_dir)[-1] / part)
        for k in wa:
            assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6), (
                part,
                k,
                (wa[k] - wb[k]).abs().max(),
            )
        start = load_safetensors_dir(
            assets.policy("llama") if part == "policy" else assets.reward_model("llama")
        )
        assert any(not torch.equal(start[k], wb[k]) for k in wb if k in start), (
            f"{part} did not train"
        )


def test_first_epoch_ratio_is_exactly_one(assets, tmp_path, monkeypatch):
    """With one epoch, the only optimiser step sees ρ = π_θ/π_old computed from the very logits π_old
    came from: no clipping and an approximate KL of exactly 0, at every step."""
    cfg = _config(assets, tmp_path / "run", reuse=True, ppo={"epochs": 1})
    counts = _run(cfg, monkeypatch)
    assert counts["experience_logits"] == 3  # π_ref only
    for row in read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        assert row["policy/approx_kl"] == 0.0 and row["policy/approx_kl_k1"] == 0.0
        assert row["policy/clipfrac"] == 0.0 and row["policy/ratio_max"] == 1.0


def test_off_when_the_first_epoch_sees_other_rows(assets, tmp_path, monkeypatch):
    """Micro-batches smaller than the batch: each first-epoch forward sees a shuffled part of it, so
    the experience keeps its own passes."""
    counts = _run(_config(assets, tmp_path / "run", reuse=True, micro=2), monkeypatch)
    assert counts["experience_critic"] == 3 * 2  # 3 steps, the batch of 4 in micro-batches of 2
    assert counts["experience_logits"] == 2 * 3 * 2
