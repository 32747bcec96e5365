"""``proximal grpo`` with the objectives of issue 25 through the real command: GSPO, GSPO-token, CISPO,
REINFORCE++ (group size 1, KL in the reward) and REINFORCE++-baseline, dual-clip and the entropy
bonus; the config combinations ``validate`` refuses, each in one line; and that the loss field's
old values keep their meaning."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_support import REQUIRED_METRICS, grpo_config, grpo_main, read_jsonl, record_gradients

from proximal.trainers.grpo_config import GRPOConfig

COMBOS = {
    # two mini-batches, two passes: the second pass is off-policy, so the clips can bind
    "gspo": [
        "--grpo.objective", "gspo", "--grpo.clip_eps", "3e-4", "--grpo.clip_eps_high", "4e-4",
        "--grpo.iterations", "2", "--grpo.mini_batch_size", "4",
    ],
    "gspo_token-reinforce_pp-kl_reward": [
        "--grpo.objective", "gspo_token", "--grpo.advantage", "reinforce_pp",
        "--grpo.kl", "reward", "--grpo.beta", "0.01", "--grpo.iterations", "2",
    ],
    "cispo-no_lower_clip": [
        "--grpo.objective", "cispo", "--grpo.clip_eps", "null", "--grpo.clip_eps_high", "0.28",
        "--grpo.iterations", "2", "--grpo.mini_batch_size", "4", "--grpo.beta", "0",
    ],
    "reinforce_pp-group_size_1": [
        "--grpo.advantage", "reinforce_pp", "--grpo.kl", "reward", "--rollout.group_size", "1",
        "--rollout.batch_size", "4", "--grpo.micro_batch_size", "2",
    ],
    "reinforce_pp_baseline-kl_loss": ["--grpo.advantage", "reinforce_pp_baseline"],
    "clip-dual_clip-entropy-kl_reward_group": [
        "--grpo.dual_clip", "3", "--grpo.entropy_coef", "0.01", "--grpo.kl", "reward",
        "--grpo.iterations", "2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("combo", list(COMBOS))
def test_cli_runs_each_objective(combo, assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = grpo_config(assets.policy("llama"), assets.prompts, run_dir)
    assert grpo_main(cfg, *COMBOS[combo]) == 0, capsys.readouterr().err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        bad = {
            k: r.get(k)
            for k in REQUIRED_METRICS
            if not (isinstance(r.get(k), (int, float)) and math.isfinite(r[k]))
        }
        if "cispo" in combo:  # β = 0: no reference, no kl/ref_k3
            bad.pop("kl/ref_k3", None)
        assert not bad, f"{combo} step {r['step']}: missing or non-finite {bad}"
        assert 0 <= r["policy/clipfrac_low"] <= 1 and 0 <= r["policy/clipfrac_high"] <= 1
        assert r["policy/optimizer_steps"] >= 1
        assert ("policy/clipfrac_dual" in r) == ("dual_clip" in combo)
        if "kl_reward" in combo or "group_size_1" in combo:
            assert r["loss/kl"] == 0.0 and r["kl/ref_k3"] >= 0  # the KL is in the reward
    # whitened over the batch's tokens: zero token mean (GSPO's statistic is a mean over responses)
    if "reinforce_pp" in combo and "gspo" not in combo:
        assert abs(rows[0]["advantage/token_mean"]) < 1e-5


def test_entropy_bonus_is_trained_on(assets, tmp_path, monkeypatch, capsys):
    """Same seed, same samples: the first step's gradient differs by the entropy term only."""
    grads = record_gradients(monkeypatch)
    for coef in ("0", "0.5"):
        cfg = grpo_config(
            assets.policy("llama"), assets.prompts, tmp_path / coef, train={"steps": 1}
        )
        assert grpo_main(cfg, "--grpo.entropy_coef", coef) == 0, capsys.readouterr().err
    plain, bonus = grads
    diff = max(float((a - b).abs().max()) for a, b in zip(plain, bonus))
    assert diff > 1e-6
    m0 = read_jsonl(tmp_path / "0" / "metrics.jsonl")[0]
    m1 = read_jsonl(tmp_path / "0.5" / "metrics.jsonl")[0]
    assert m0["policy/entropy"] == pytest.approx(m1["policy/entropy"], rel=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--grpo.objective", "gspo", "--grpo.loss", "dapo"],
            "grpo.loss = 'dapo' cannot be used with grpo.objective gspo, whose loss is a mean "
            "over responses: set grpo.loss to null (or grpo)",
        ),
        (
            ["--grpo.objective", "cispo", "--grpo.loss", "grpo"],
            "grpo.loss = 'grpo' cannot be used with grpo.objective cispo, whose loss is a mean "
            "over every token: set grpo.loss to null (or dapo)",
        ),
        (
            ["--grpo.objective", "gspo", "--grpo.advantage", "reinforce_pp"],
            "grpo.objective gspo takes one advantage per response, but grpo.advantage "
            "reinforce_pp gives one per token: use grpo.objective gspo_token",
        ),
        (
            ["--grpo.objective", "gspo", "--grpo.kl", "reward"],
            "but grpo.kl reward gives one per token",
        ),
        (["--grpo.clip_eps", "null"], "grpo.clip_eps = null (no lower clip) is only for"),
        (
            ["--grpo.objective", "cispo", "--grpo.clip_eps", "null"],
            "grpo.objective cispo needs grpo.clip_eps_high",
        ),
        (["--grpo.dual_clip", "1"], "grpo.dual_clip = 1.0 must lie in (1, ∞)"),
        (
            ["--grpo.objective", "gspo", "--grpo.dual_clip", "3"],
            "grpo.dual_clip bounds the clipped token surrogate of grpo.objective clip",
        ),
        (["--grpo.entropy_coef", "-1"], "grpo.entropy_coef = -1.0 must lie in [0, ∞)"),
        (
            ["--rollout.group_size", "1", "--grpo.advantage", "reinforce_pp_baseline"],
            "rollout.group_size = 1 must be ≥ 2 with grpo.advantage reinforce_pp_baseline",
        ),
        (
            ["--rollout.group_size", "1", "--grpo.advantage", "reinforce_pp",
             "--grpo.skip_uniform_groups", "true"],
            "grpo.skip_uniform_groups needs rollout.group_size ≥ 2",
        ),
        (["--grpo.kl", "reward", "--grpo.beta", "0"], "grpo.kl = reward with grpo.beta = 0"),
        (["--grpo.objective", "ppo"], "grpo.objective: 'ppo' is not one of 'clip', 'gspo'"),
        (["--grpo.kl", "both"], "grpo.kl: 'both' is not one of 'loss', 'reward'"),
    ],
)  # fmt: skip
def test_bad_objective_config_is_one_line_and_exit_2(args, message, assets, tmp_path, capsys):
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    assert grpo_main(cfg, *args) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_loss_values_keep_their_meaning():
    cfg = GRPOConfig()
    assert cfg.grpo.loss is None and cfg.aggregation == "seq-mean-token-mean"
    for loss, agg in (
        ("grpo", "seq-mean-token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
        ("dapo", "token-mean"),
    ):
        cfg.grpo.loss = loss
        assert cfg.aggregation == agg
    cfg.grpo.loss = None
    for objective, agg in (
        ("gspo", "seq-mean-token-mean"),
        ("gspo_token", "seq-mean-token-mean"),
        ("cispo", "token-mean"),
    ):
        cfg.grpo.objective = objective
        assert cfg.aggregation == agg


def test_ppo_dual_clip_runs_and_is_logged(assets, tmp_path, capsys):
    from ppo_support import ppo_main, tiny_config

    run_dir = tmp_path / "run"
    cfg = tiny_config(
        assets.policy("llama"), assets.prompts, run_dir, ppo={"epochs": 2, "mini_batch_size": 2}
    )
    assert ppo_main(cfg, "--ppo.dual_clip", "3") == 0, capsys.readouterr().err
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        assert 0 <= r["policy/clipfrac_dual"] <= 1
    assert ppo_main(cfg, "--ppo.dual_clip", "0.5", "--output.overwrite", "true") == 2
    assert "ppo.dual_clip = 0.5 must lie in (1, ∞)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 1 process vs 2 (the pattern of test_grpo_update.py's test_one_and_two_processes_compute_the_same_steps)
# ----------------------------------------------------------------------------------------------

INVARIANCE = {
    "gspo": {"objective": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4},
    "gspo_token-reinforce_pp-kl_reward": {
        "objective": "gspo_token",
        "advantage": "reinforce_pp",
        "kl": "reward",
    },
    "cispo": {"objective": "cispo", "clip_eps": None, "clip_eps_high": 0.005},
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline"},
    "clip-dual_clip-entropy": {"dual_clip": 1.01, "clip_eps": 0.005, "entropy_coef": 0.01},
}


@pytest.mark.parametrize("name", list(INVARIANCE))
def test_one_and_two_processes_compute_the_same_steps(name, assets, tmp_path, monkeypatch):
    """Each new objective's two steps (μ = 2 iterations of 2 mini-batches, responses of many
    lengths, tight clips so the second pass clips) on one process and on two forked gloo ranks with
    FSDP2: every optimiser step's full gradient at rtol 1e-4 and the logged metrics at rel 1e-4, the
    tolerances of the GRPO test."""
    from multiproc import run_ranks
    from ppo_support import TIMING_PREFIXES
    from test_grpo_update import VARIED_LENGTHS, _train_on_rank

    from proximal.trainers import grpo

    grads = record_gradients(monkeypatch)
    grpo.clip_and_step.grads = grads

    def config(run):
        return grpo_config(
            assets.policy("llama"),
            assets.prompts,
            tmp_path / run / "run",
            grpo={
                "iterations": 2,
                "mini_batch_size": 4,
                "micro_batch_size": 1,
                "beta": 0.1,
                **INVARIANCE[name],
            },
            rollout=VARIED_LENGTHS,
            model={"reward_functions": ["ppo_support:length"]},  # scores that differ in a group
            optim={"lr": 1e-2},
            train={"steps": 2},
        )

    (tmp_path / "one").mkdir()
    one_grads, one_rows = _train_on_rank(config("one"), tmp_path / "one")
    (tmp_path / "two").mkdir()
    [(two_grads, two_rows), (other_grads, _)] = run_ranks(
        2, _train_on_rank, config("two"), tmp_path / "two", timeout_s=180
    )
    assert len(one_grads) == len(two_grads) == len(other_grads) == 2 * 2 * 2
    for i, (a, b, c) in enumerate(zip(one_grads, two_grads, other_grads)):
        for x, y, z in zip(a, b, c):
            assert torch.equal(y, z)
            torch.testing.assert_close(
                x, y, rtol=1e-4, atol=1e-6, msg=lambda m: f"optimiser step {i}: {m}"
            )
    assert (
        max(r["policy/clipfrac"] for r in one_rows) > 0
    )  # the second pass is off-policy and clips
    for r1, r2 in zip(one_rows, two_rows):
        for k, v in r1.items():
            if k.startswith(TIMING_PREFIXES) or not isinstance(v, (int, float)):
                continue
            assert r2[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
